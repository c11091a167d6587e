import io

from headroom.client.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_redraws_and_a_log_gets_one_line():
    terminal = FakeTerminal()
    bar = Progress(3, "hom_c8_2k_each", stream=terminal)
    for ok in (True, False, True):
        bar.advance(ok)
    assert terminal.getvalue().count("\r") == 3 and "3/3" in terminal.getvalue() and "1 failed" in terminal.getvalue()
    log = io.StringIO()
    bar = Progress(2, "x", stream=log)
    bar.advance()
    assert log.getvalue() == ""
    bar.advance()
    assert log.getvalue().count("\n") == 1 and "2/2" in log.getvalue()
    silent = io.StringIO()
    Progress(1, "x", enabled=False, stream=silent).advance()
    assert silent.getvalue() == ""
