"""Incremental detokenization: streamed deltas add up to the whole text; stop strings and split UTF-8."""

from __future__ import annotations

import pytest
from headroom.engine.server.generate import TextAssembler
from headroom.engine.server.tokenizer import ByteTokenizer

TEXT = "naïve café — 東京 ok. Done.\nnext line 🙂 end"


def stream(assembler: TextAssembler, ids: list[int], step: int) -> tuple[str, bool]:
    out, stopped = [], False
    for i in range(0, len(ids), step):
        delta, stopped = assembler.add(ids[i:i + step], final=i + step >= len(ids))
        out.append(delta)
        if stopped:
            break
    return "".join(out), stopped


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_deltas_add_up_to_the_whole_text_whatever_the_token_steps(step):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    text, stopped = stream(TextAssembler(tokenizer, []), ids, step)
    assert text == TEXT and not stopped


@pytest.mark.parametrize("step", [1, 4])
def test_a_stop_string_ends_the_text_before_it(step):
    tokenizer = ByteTokenizer()
    text, stopped = stream(TextAssembler(tokenizer, ["Done.", "東京 ok"]), tokenizer.encode(TEXT), step)
    assert stopped and text == "naïve café — "


def test_no_half_character_is_ever_sent():
    tokenizer = ByteTokenizer()
    assembler = TextAssembler(tokenizer, [])
    for token in tokenizer.encode("🙂"):
        delta, _ = assembler.add([token], final=False)
        assert "\ufffd" not in delta
    assert assembler.text == "🙂"


@pytest.mark.parametrize("style", ["metaspace", "bytelevel"])
def test_subword_tokenizers_keep_their_spacing_when_decoded_in_windows(tmp_path, style):
    from headroom.engine.server.tokenizer import HFTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if style == "metaspace":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet: list[str] = []
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    corpus = ["the quick brown fox jumps over the lazy dog", "a stream of words, spaced and punctuated!"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"],
                                                        initial_alphabet=alphabet))
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    sentence = "the lazy fox jumps over a brown dog, quick and spaced!"
    ids = tokenizer.encode(sentence)
    for step in (1, 2, 5):
        text, _ = stream(TextAssembler(tokenizer, []), ids, step)
        assert text == tokenizer.decode(ids)


def _tokenizer_with_template(tmp_path, template: str):
    import json

    from headroom.engine.server.tokenizer import HFTokenizer
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return HFTokenizer(tmp_path)


def test_chat_templates_render_in_a_sandbox(tmp_path):
    good = _tokenizer_with_template(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert good.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    # A model's template is untrusted input: walking to Python internals is refused, as a clear error.
    hostile = _tokenizer_with_template(tmp_path, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template"):
        hostile.apply_chat_template([{"role": "user", "content": "hi"}])
    raising = _tokenizer_with_template(tmp_path, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])
