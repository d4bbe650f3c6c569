"""Text tokenizer on the real Qwen2 vocabulary: ids, both regexes, special tokens, incremental use."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine.text import REF_SUFFIX, ROLE_PREFIX, TARGET_SUFFIX, TextTokenizer, normalize_text


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return TextTokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def patched(tiny_model_dir):
    return TextTokenizer(tiny_model_dir, patched_regex=True)


def test_known_ids(tok):
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("assistant") == [77091]
    assert tok.encode("\n") == [198]
    assert tok.encode(ROLE_PREFIX) == [151644, 77091, 198]


def test_regexes_differ_on_camel_case(tok, patched):
    assert tok.encode(" iPhone") == [12167]
    assert patched.encode(" iPhone") == [600, 6939]
    assert tok.encode("iPhone") != patched.encode("iPhone")
    assert tok.encode("Hello world, this is fine.") == patched.encode("Hello world, this is fine.")


def test_special_tokens_split_off_before_bpe(tok):
    specials = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|audio_start|>": 151669,
                "<|audio_end|>": 151670, "<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673,
                "<tts_text_bos_single>": 151674, "<|audio_pad|>": 151675}
    for text, id_ in specials.items():
        assert tok.encode(text) == [id_]
        assert tok.encode(f"a{text}b") == [64, id_, 65]
    assert tok.tokenizer.get_vocab_size(with_added_tokens=True) == 151676
    assert tok.encode("<|im_end") != [151645]          # a fragment is plain text
    assert tok.decode([9707, 1879, 151645]) == "Hello world<|im_end|>"


def test_golden_ids(tok, patched, golden_cases, golden_npz):
    checked = 0
    for name, case in golden_cases.items():
        if case["kind"] != "generate_voice_clone":
            continue
        z = golden_npz(name)
        for i, item in enumerate(case["items"]):
            ids = z[f"input_ids_{i}"].tolist()
            for t in (tok, patched):
                assert t.encode(ROLE_PREFIX + item["text"] + TARGET_SUFFIX) == ids
            assert tok.text_ids(item["text"]) == ids[3:-5]
            if case["ref_text"]:
                ref = z[f"ref_ids_{i}"].tolist()
                assert tok.encode(ROLE_PREFIX + case["ref_text"] + REF_SUFFIX) == ref
                assert tok.ref_text_ids(case["ref_text"]) == ref[3:-2]
            checked += 1
    assert checked == 17
    for ref in ("ref_en", "ref_synth", "ref_calib"):
        case = golden_cases[f"refaudio_{ref}"]
        ids = golden_npz(ref)["ref_text_ids"].tolist()
        assert tok.encode(ROLE_PREFIX + case["ref_text"] + REF_SUFFIX) == ids


def test_leading_newlines_are_stripped(tok):
    """T3: officially "\\nHi" merges with the role's newline (271) and loses it; we strip it."""
    assert tok.encode(ROLE_PREFIX + "\nHi")[2] == 271            # the trap: "\n\n" is one token
    assert normalize_text("\n\nHi") == "Hi"
    assert normalize_text(" \r\n  Hi \n") == "  Hi \n"             # up to the last leading break only
    assert normalize_text("  Hi") == "  Hi"                        # no break: unchanged (not lossy)
    assert tok.text_ids("\n\nHi") == tok.text_ids("Hi")
    assert tok.encode(ROLE_PREFIX + normalize_text("\nHi"))[:3] == [151644, 77091, 198]
    for text in ("  Hi", " Hi", "Hi\n\nthere"):                    # role "\n" stays its own token
        assert tok.encode(ROLE_PREFIX + text + TARGET_SUFFIX)[3:-5] == tok.text_ids(text)


def _pieces(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _incremental(tok, pieces):
    inc = tok.incremental()
    ids = []
    for p in pieces:
        ids += inc.push(p)
    return ids + inc.finish()


ALPHABET = list("aAbBzZ iIpP'sStTdDlLmMrReEvV0123456789.,!?;:/-_<>|\"\t\n\r") + \
    ["\u00e9", "e\u0301", "\u0301", "\u0323", "\u4f60", "\u597d", "\uff0c", "\u3002", "\u00bf", "\u00f1",
     "\uac00", "\u1100", "\u1161", "\u11a8", "<|im_end|>", "<|im_", "<tts_pad>", "'s", "'ll", "  ", "\n\n", "\u00a0"]
TEXTS = st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_incremental_equals_whole(tok, text, cuts):
    assert _incremental(tok, _pieces(text, cuts)) == tok.text_ids(text)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_incremental_equals_whole_patched(patched, text, cuts):
    assert _incremental(patched, _pieces(text, cuts)) == patched.text_ids(text)


def test_incremental_commits_early(tok):
    """Ids come out before the text is finished (a chunk or two behind), even fed a character at a time."""
    text = "Hello world, this is a streaming speech test. 你好，世界！"
    inc = tok.incremental()
    seen = []
    for ch in text:
        seen.append(len(inc.push(ch)))
    total = sum(seen) + len(inc.finish())
    assert total == len(tok.text_ids(text))
    assert sum(seen) >= total - 3                 # only the last chunk(s) wait for finish()
    inc = tok.incremental()
    assert inc.push("Hello world, ") == tok.encode("Hello world")
    assert inc.push("\n\n") == tok.encode(",")
    assert inc.finish() == tok.encode(" \n\n")
    with pytest.raises(RuntimeError):
        inc.push("more")


def test_incremental_leading_whitespace(tok):
    inc = tok.incremental()
    assert inc.push("\n  ") == [] and inc.push("\n") == []
    assert inc.push(" Hi there") == tok.encode(" Hi")
    assert inc.finish() == tok.encode(" there")
    inc = tok.incremental()
    assert inc.push("  ") == [] and inc.finish() == tok.text_ids("  ")
    assert np.array_equal(_incremental(tok, ["\r", "\n", "x y"]), tok.text_ids("\r\nx y"))


@settings(max_examples=100, deadline=None)
@given(text=TEXTS)
def test_incremental_char_by_char(tok, text):
    assert _incremental(tok, list(text)) == tok.text_ids(text)
