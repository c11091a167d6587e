import json

import pytest
from headroom.client.prompts import (
    DEFAULT_ID_RANGE,
    SOURCE_TEXT,
    PromptFactory,
    from_id_range,
    from_tokenizer_file,
)


def test_prompts_have_exact_length_and_are_deterministic():
    factory = from_id_range(*DEFAULT_ID_RANGE)
    for length in (1, 7, 2189, 4323):
        prompt = factory.make(length, session=3)
        assert len(prompt) == length
        assert all(DEFAULT_ID_RANGE[0] <= i < DEFAULT_ID_RANGE[1] for i in prompt)
        assert prompt == factory.make(length, session=3)


def test_sessions_differ_and_revisits_share_the_session_prefix():
    factory = from_id_range(32, 127)
    assert factory.make(64, session=1) != factory.make(64, session=2)
    first = factory.session_prompt(100, 10, session=5, visit=1)
    second = factory.session_prompt(100, 10, session=5, visit=2)
    assert first[:100] == second[:100] and first[100:] != second[100:]
    assert len(first) == len(second) == 110


def test_bad_sizes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="got 0"):
        from_id_range(32, 127).make(0, session=1)
    with pytest.raises(ValueError, match="5..5"):
        from_id_range(5, 5)
    with pytest.raises(ValueError, match="3 distinct ids"):
        PromptFactory((1, 2, 3), "tiny")


def test_tokenizer_file_source(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: index for index, word in enumerate(sorted(set(SOURCE_TEXT.split())))}
    vocab["[UNK]"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    factory = from_tokenizer_file(path)
    assert set(factory.vocabulary) <= set(vocab.values())
    assert len(factory.vocabulary) >= 16 and "tokenizer file" in json.dumps(factory.to_dict())
