"""Finish rules added for SGLang's parameters: min_new_tokens (EOS and stop tokens do not end
the output early), stop_regex, and the front's no_stop_trim / skip_special_tokens text."""

from __future__ import annotations

import numpy as np
import pytest

from dllm_serve.managers.detokenizer import IncrementalDetokenizer
from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.req import Req
from dllm_serve.sampling_params import SamplingParams
from dllm_serve.utils.text import MAX_CANDIDATES, TAIL_CHARS, partial_stop_len

EOS = 98


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def req(**params: object) -> Req:
    return Req("r", np.arange(3, dtype=np.int64), SamplingParams(**params), 0.0, 4, 0)


def commit(checker: FinishChecker, r: Req, tokens: list[int]) -> list[int]:
    return checker.commit(r, np.asarray(tokens, dtype=np.int64)).tolist()


def test_eos_does_not_finish_before_min_new_tokens() -> None:
    checker = FinishChecker({EOS}, letters)
    r = req(max_new_tokens=10, min_new_tokens=3)
    assert commit(checker, r, [EOS, EOS, 5, EOS]) == [EOS, EOS, 5, EOS]
    assert r.finish_reason == {"type": "stop", "matched": EOS}
    r = req(max_new_tokens=10, min_new_tokens=3, stop_token_ids=[5])
    assert commit(checker, r, [5, 1, 5, 2]) == [5, 1, 5, 2] and not r.finished
    r = req(max_new_tokens=10, min_new_tokens=3, stop_token_ids=[5])
    assert commit(checker, r, [5, 1, 5, 5, 5]) == [5, 1, 5, 5]  # 3 tokens before the stop
    assert r.finish_reason == {"type": "stop", "matched": 5}
    r = req(max_new_tokens=2, min_new_tokens=2)
    assert commit(checker, r, [EOS, 5, EOS]) == [EOS, 5]
    assert r.finish_reason == {"type": "length", "length": 2}


def test_stop_regex_finishes_at_the_earliest_match() -> None:
    checker = FinishChecker({EOS}, letters)
    r = req(max_new_tokens=20, stop_regex=[r"c+d"], stop=["zz"])
    assert commit(checker, r, [0, 1, 2, 2, 3, 4]) == [0, 1, 2, 2, 3]  # "abccd"
    assert r.finish_reason == {"type": "stop", "matched": "ccd", "at": 2}
    r = req(max_new_tokens=20, stop_regex=[r"x"], stop=["bc"])
    assert commit(checker, r, [0, 1, 2, 23]) == [0, 1, 2]  # "bc" comes before "x"
    assert r.finish_reason == {"type": "stop", "matched": "bc", "at": 1}


def test_a_regex_match_is_cut_where_it_starts_not_at_its_text_s_first_occurrence() -> None:
    """Regression: the front cut a stop_regex finish at the first occurrence of the matched
    text; with a lookbehind the match ("bb" after "c") comes after an earlier "bb" that does
    not match, and the non-streamed text was cut too early."""
    r = req(max_new_tokens=20, stop_regex=[r"(?<=c)bb"])
    out = commit(FinishChecker({EOS}, letters), r, [1, 1, 2, 1, 1, 0])  # "bbcbba"
    assert out == [1, 1, 2, 1, 1] and r.finish_reason == {"type": "stop", "matched": "bb",
                                                          "at": 3}
    reason = dict(r.finish_reason)
    at = reason.pop("at")
    assert IncrementalDetokenizer(letters, []).update(out, reason, at) == "bbc"
    assert IncrementalDetokenizer(letters, [], keep_stop=True).update(out, reason, at) == "bbcbb"


def test_stop_strings_are_found_in_the_text_the_client_gets() -> None:
    """Regression: stop strings were searched in text decoded without special tokens even when
    the request kept them (skip_special_tokens false): one made of a special token's text
    never matched, and one could match across a special token hidden from the search."""
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("<S>" if i == 9 else "" if i == 8 and skip_special_tokens else
                       "<T>" if i == 8 else chr(ord("a") + i) for i in ids)

    checker = FinishChecker({EOS}, decode)
    kept = req(max_new_tokens=20, stop=["<T>"], skip_special_tokens=False)
    assert commit(checker, kept, [0, 8, 1]) == [0, 8]
    assert kept.finish_reason == {"type": "stop", "matched": "<T>"}
    across = req(max_new_tokens=20, stop=["ab"], skip_special_tokens=False)  # "a<T>b"
    assert commit(checker, across, [0, 8, 1, 2]) == [0, 8, 1, 2] and not across.finished
    skipped = req(max_new_tokens=20, stop=["ab"])  # the client's text is "ab": it stops
    assert commit(checker, skipped, [0, 8, 1, 2]) == [0, 8, 1]


def test_a_request_s_regex_searches_share_one_time_limit_a_commit(monkeypatch) -> None:
    """STOP_REGEX_TIMEOUT_S bounds all of a request's regex searches at one commit together:
    of three patterns that each take 30 ms (a fake clock) the first gets 50 ms, the second the
    20 left, runs out and ends the request with a 400 naming it, and the third is never
    searched: the scheduler is held 50 ms, not 90 (nor N x 50 ms for N slow patterns)."""
    import dllm_serve.managers.finish as finish

    clock = [100.0]
    timeouts: list[tuple[str, float]] = []

    class SlowRegex:
        @staticmethod
        def search(pattern: str, text: str, timeout: float) -> None:
            timeouts.append((pattern, timeout))
            clock[0] += 0.03
            if clock[0] > start + finish.STOP_REGEX_TIMEOUT_S:
                raise TimeoutError

    monkeypatch.setattr(finish, "regex", SlowRegex)
    monkeypatch.setattr(finish.time, "monotonic", lambda: clock[0])
    start = clock[0]
    r = req(max_new_tokens=20, stop_regex=["p1", "p2", "p3"])
    commit(FinishChecker({EOS}, letters), r, [0, 1, 2])
    assert [p for p, _ in timeouts] == ["p1", "p2"]
    assert timeouts[0][1] == pytest.approx(0.05) and timeouts[1][1] == pytest.approx(0.02)
    assert r.finish_reason["type"] == "abort" and r.finish_reason["status_code"] == 400
    assert "'p2'" in r.finish_reason["message"]


def test_a_runaway_stop_regex_ends_its_request_with_a_400() -> None:
    """A pattern that backtracks without end is cut at the time limit (the real `regex`)."""
    r = req(max_new_tokens=40, stop_regex=[r"(a|aa)+$b"])
    commit(FinishChecker({EOS}, lambda ids: "a" * 64), r, [0] * 8)
    assert r.finish_reason["type"] == "abort" and r.finish_reason["status_code"] == 400
    assert "stop_regex searches took longer" in r.finish_reason["message"]


def test_detokenizer_trims_or_keeps_the_stop_string() -> None:
    reason = {"type": "stop", "matched": "ccd"}
    trim = IncrementalDetokenizer(letters, [])
    assert trim.update([0, 1, 2, 2, 3], reason) == "ab"
    keep = IncrementalDetokenizer(letters, [], keep_stop=True)
    assert keep.update([0, 1, 2, 2, 3], reason) == "abccd"


def test_detokenizer_trims_a_stop_token_s_text_as_sglang() -> None:
    """A finish on a stop token (a stop_token_ids entry, or EOS kept as text with
    skip_special_tokens false) leaves that token's text out, as SGLang's trim does; with
    keep_stop (no_stop_trim) it stays."""
    reason = {"type": "stop", "matched": 3}
    assert IncrementalDetokenizer(letters, []).update([0, 1, 3], reason) == "ab"
    assert IncrementalDetokenizer(letters, [], keep_stop=True).update([0, 1, 3], reason) == "abd"
    streamed = IncrementalDetokenizer(letters, [])
    assert streamed.update([0, 1], None) + streamed.update([0, 1, 2, 3], reason) == "abc"


def test_partial_stop_len_is_the_longest_suffix_that_begins_a_stop_string() -> None:
    """The stop-string hold-back against trying every length: random texts and stop strings
    over small alphabets (many partial matches, periodic strings such as "abab..."), of every
    length around the tail it looks for (partial_stop_len finds lengths past TAIL_CHARS
    through that tail). Exact wherever each stop string has fewer than MAX_CANDIDATES lengths
    past its exact one that end in the text's tail (the lengths it compares whole); never less
    than exact and never more than the text."""
    rng = np.random.default_rng(7)

    def exact(text: str, stop: str) -> int:
        return max((n for n in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:n])), default=0)

    def failing_candidates(text: str, stop: str) -> int:
        tail = text[-TAIL_CHARS:]
        return sum(stop[n - len(tail):n] == tail for n in range(
            max(exact(text, stop) + 1, len(tail)), min(len(stop) - 1, len(text)) + 1))

    bounded = 0
    for case in range(3000):
        alphabet = "ab" if case % 3 == 0 else "abc" if case % 3 == 1 else "abcdefgh"

        def word(most: int, alphabet: str = alphabet) -> str:
            return "".join(rng.choice(list(alphabet), int(rng.integers(0, most))))
        unit = word(4) or "a"
        stops = [word(60) if rng.random() < 0.6 else unit * int(rng.integers(1, 30))
                 for _ in range(int(rng.integers(0, 4)))]
        text = word(50) + (rng.choice(stops)[:int(rng.integers(0, 60))] if stops else "")
        got, want = partial_stop_len(text, stops), max((exact(text, s) for s in stops),
                                                        default=0)
        if all(failing_candidates(text, s) < MAX_CANDIDATES for s in stops):
            assert got == want, (text, stops)
        else:
            bounded += 1
            assert want <= got <= len(text), (text, stops)
    assert 0 < bounded < 300  # both kinds of case were drawn


def test_partial_stop_len_is_bounded_on_periodic_stop_strings() -> None:
    """A text ending in a run of "a" shorter than stop strings of long runs of "a": every length
    is a candidate and fails until the run's own (4,000 lengths a stop when each was compared
    whole: 129 ms a block for 100 such stops, on the front's one receive thread). It holds back
    a bound instead: at least the exact 200 characters, at most the text."""
    text = "x" * 5000 + "a" * 200
    stops = ["a" * 4096 + str(i) for i in range(100)]
    assert 200 <= partial_stop_len(text, stops) <= len(text)
    assert partial_stop_len("x" * 5000 + "a" * 200, ["a" * 150 + "1"]) == 150


def test_from_dict_maps_sglang_spellings() -> None:
    p = SamplingParams.from_dict({"stop": "x", "stop_regex": "a+", "top_k": -1, "n": 1,
                                  "min_p": 0.0, "stop_token_ids": None, "regex": None,
                                  "json_schema": None, "frequency_penalty": 0.0,
                                  "skip_special_tokens": True, "custom_params": {"a": 1},
                                  "max_new_tokens": None, "dllm_threshold": 0.5})
    assert p.stop == ["x"] and p.stop_regex == ["a+"] and p.stop_token_ids == []
    assert p.max_new_tokens is None and p.dllm == {"threshold": 0.5}


def test_min_new_tokens_through_scheduler_and_worker() -> None:
    """Every generated token is EOS: the request runs past the early ones (the worker does not
    drop it at the first) and ends at the first EOS with min_new_tokens tokens before it (as
    SGLang and vLLM count it)."""
    from local_engine import scripted_engine

    e = scripted_engine(fill=14, eos=14)
    e.submit("a", [1, 2], max_new_tokens=12, min_new_tokens=6)
    e.submit("b", [1, 2], max_new_tokens=12)
    outs = e.run()
    assert outs["a"][-1].completion_tokens == 7
    assert outs["a"][-1].finish_reason == {"type": "stop", "matched": 14}
    assert outs["b"][-1].completion_tokens == 1


def token_by_token(checker: FinishChecker, r: Req, tokens: list[int]) -> list[int]:
    """The finish rules one token at a time, as the module docstring states them (the
    oracle of the vectorised commit)."""
    p, added = r.params, []
    for t in tokens:
        r.output_ids.append(t)
        added.append(t)
        n = len(r.output_ids)
        stop = n > p.min_new_tokens and (
            (t in checker.eos_ids and not p.ignore_eos) or t in p.stop_token_ids)
        r.finish_reason = ({"type": "stop", "matched": t} if stop else
                           {"type": "length", "length": p.max_new_tokens}
                           if n >= p.max_new_tokens else None)
        if r.finish_reason is not None:
            break
    return added


def test_commit_equals_the_rules_token_by_token() -> None:
    """Random blocks of EOS, stop ids and other tokens, committed in turns until the request
    finishes, with random max / min_new_tokens, ignore_eos and stop ids: the same tokens and
    the same finish as the token-by-token rules."""
    rng = np.random.default_rng(0)
    checker = FinishChecker({EOS, 99}, None)
    for _ in range(2000):
        max_new = int(rng.integers(1, 40))
        params = {"max_new_tokens": max_new, "min_new_tokens": int(rng.integers(0, max_new + 1)),
                  "ignore_eos": bool(rng.random() < 0.3),
                  "stop_token_ids": [int(t) for t in rng.choice([5, 6, 7], rng.integers(0, 3))]}
        fast, slow = req(**params), req(**params)
        while not fast.finished:
            block = rng.choice([1, 2, 3, 5, 6, 7, EOS, 99], size=int(rng.integers(1, 9)),
                               p=[0.3, 0.2, 0.2, 0.06, 0.06, 0.06, 0.06, 0.06]).tolist()
            assert commit(checker, fast, block) == token_by_token(checker, slow, block)
            assert fast.output_ids == slow.output_ids
            assert fast.finish_reason == slow.finish_reason
        assert slow.finished and len(fast.output_ids) <= max_new


def test_stop_sets_are_made_once_a_request_and_their_caches_stay_bounded(
        monkeypatch: object) -> None:
    """A request's stop set is made once (not per committed block: a client may send
    millions of stop ids), and clients that send a new set with every request do not grow the
    scheduler's caches past STOP_SETS_KEPT sets, nor keep a set of more than
    STOP_SET_SHARED_IDS ids; each request still stops on its own ids."""
    from local_engine import scripted_engine

    from dllm_serve.managers.finish import STOP_SET_SHARED_IDS, STOP_SETS_KEPT

    e = scripted_engine(fill=7, mrr=4, pages=64)
    made = []
    shared = e.sched.finish._shared_stop_set
    e.sched.finish._shared_stop_set = lambda r: made.append(r.rid) or shared(r)  # type: ignore
    n = STOP_SETS_KEPT + 40
    for i in range(n):  # every request stops at its first token (7), each its own set
        e.submit(f"r{i}", [1, 2], max_new_tokens=4, stop_token_ids=[7, 100 + i])
    e.submit("long", [1, 2], max_new_tokens=12, ignore_eos=True, stop_token_ids=[9])
    big = list(range(1000, 1000 + 4 * STOP_SET_SHARED_IDS))
    e.submit("big", [1, 2], max_new_tokens=4, stop_token_ids=[7, *big])
    e.submit("big-again", [1, 2], max_new_tokens=4, stop_token_ids=[*big, 7])
    outs = e.run()
    assert all(outs[f"r{i}"][-1].finish_reason == {"type": "stop", "matched": 7}
               for i in range(n))
    assert outs["long"][-1].completion_tokens == 12  # three blocks, one stop set
    assert sorted(made) == sorted([f"r{i}" for i in range(n)] + ["long", "big", "big-again"])
    assert all(outs[r][-1].finish_reason == {"type": "stop", "matched": 7}
               for r in ("big", "big-again"))
    assert 0 < len(e.sched.finish._stop_sets) <= STOP_SETS_KEPT
    assert 0 < len(e.sched._stop_arrays) <= STOP_SETS_KEPT
    assert max(len(ids) for ids, _ in e.sched.finish._stop_sets) <= STOP_SET_SHARED_IDS
    assert max(len(s) for s in e.sched._stop_arrays) <= STOP_SET_SHARED_IDS + 1  # + EOS
    e.assert_whole()


def full_text_stop(decode: object, r: Req, tokens: list[int]) -> None:
    """The stop-string rule over the whole decoded output (the oracle of the windowed
    search): finish at the first prefix of the output whose text holds a stop string."""
    start = len(r.output_ids)
    r.output_ids.extend(tokens)
    stops = r.params.stop
    if not any(s in decode(r.output_ids) for s in stops):  # type: ignore[operator]
        return
    for n in range(start + 1, len(r.output_ids) + 1):
        text = decode(r.output_ids[:n])  # type: ignore[operator]
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            del r.output_ids[n:]
            r.finish_reason = {"type": "stop", "matched": min(hits)[1]}
            return


def test_stop_strings_found_in_a_window_as_in_the_whole_text() -> None:
    """A commit looks for stop strings in its new tokens' text and a window before it (not
    the whole output, which made a commit cost grow with the output): with the built-in
    model's tokenizer, random outputs built of text that holds the stop strings and of
    special tokens (which decode to nothing), committed in random blocks, finish at the
    same token with the same match as a search of the whole text."""
    from dllm_serve.default_model import default_model_path
    from dllm_serve.tokenizer import Tokenizer

    tok = Tokenizer.load(str(default_model_path()))
    rng = np.random.default_rng(1)
    pieces = ["Question", "Question:", " Answer: 42", "Assistant:", "\n\n", " the", " 7",
              " apples", "ion", "Quest", "Assist", "é", "日本", " <|separator|>", "<|sep"]
    specials = tok.encode("<|endoftext|><|mask|>", add_special_tokens=False)
    stop_sets = [["Question"], ["Question", "Assistant:", "<|separator|>"], ["\n\n"], ["ion A"],
                 ["日本"]]
    checker = FinishChecker(set(), tok.decode)
    finished = 0
    for case in range(300):
        text = "".join(rng.choice(pieces, size=int(rng.integers(1, 60))))
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(int(rng.integers(0, 4))):  # tokens that decode to nothing
            ids.insert(int(rng.integers(0, len(ids) + 1)), int(rng.choice(specials)))
        stops = stop_sets[case % len(stop_sets)]
        fast = req(max_new_tokens=10_000, stop=stops, ignore_eos=True)
        slow = req(max_new_tokens=10_000, stop=stops, ignore_eos=True)
        at = 0
        while at < len(ids) and not fast.finished:
            block = ids[at:at + int(rng.integers(1, 33))]
            at += len(block)
            checker.commit(fast, np.asarray(block, dtype=np.int64))
            full_text_stop(tok.decode, slow, block)
            assert fast.output_ids == slow.output_ids, (case, text, stops)
            assert fast.finish_reason == slow.finish_reason, (case, text, stops)
        finished += fast.finished
    assert 100 < finished < 300  # most outputs hold a stop string, some none


def whole_text_update(decode, stops: list[str], keep_stop: bool):
    """The detokenizer's rule on the whole output decoded again at every update (reference)."""
    sent = 0

    def update(ids: list[int], reason: dict | None) -> tuple[str, str]:
        nonlocal sent
        text = decode(ids)
        if reason is None:
            limit = len(text) - partial_stop_len(text, stops)
            while limit > 0 and text[limit - 1] == "\ufffd":
                limit -= 1
        else:
            if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
                cut = text.find(reason["matched"])
                if cut >= 0:
                    text = text[:cut + len(reason["matched"]) if keep_stop else cut]
            limit = len(text)
        limit = max(limit, sent)
        delta, sent = text[sent:limit], limit
        return delta, text[:limit]

    return update


def test_detokenizer_decodes_only_new_tokens_and_gives_the_whole_text_deltas() -> None:
    """An update decodes the new tokens and a few before them, not the whole output: with the
    built-in model's tokenizer (both skip_special_tokens settings), random outputs of text,
    multi-byte characters, special tokens and raw byte tokens that leave characters half
    done or invalid, in random blocks, give the same deltas and text as decoding the whole
    output at every block; and no decode is longer than the tokens since the output last ended
    in a whole character and the context (CONTEXT_TOKENS) before them."""
    from dllm_serve.default_model import default_model_path
    from dllm_serve.tokenizer import Tokenizer
    from dllm_serve.utils.text import CONTEXT_TOKENS

    tok = Tokenizer.load(str(default_model_path()))
    rng = np.random.default_rng(2)
    pieces = [" Question", " 42", "\n\n", " apples", "é", "日本", "🙂", " <|separator|>", "ab"]
    specials = tok.encode("<|endoftext|><|mask|>", add_special_tokens=False)
    lengths: list[int] = []
    for case in range(200):
        skip = bool(case % 2)
        ids = tok.encode("".join(rng.choice(pieces, size=int(rng.integers(1, 80)))),
                         add_special_tokens=False)
        for _ in range(int(rng.integers(0, 8))):  # specials and raw vocabulary ids
            extra = int(rng.choice(specials)) if rng.random() < 0.5 else int(rng.integers(0, 256))
            ids.insert(int(rng.integers(0, len(ids) + 1)), extra)

        def decode(part: list[int], skip: bool = skip) -> str:
            lengths.append(len(part))
            return tok.decode(part, skip_special_tokens=skip)

        stops = [["apples"], [], ["\n\n", "日"]][case % 3]
        fast = IncrementalDetokenizer(decode, stops, keep_stop=case % 5 == 0)
        slow = whole_text_update(lambda p, skip=skip: tok.decode(p, skip_special_tokens=skip),
                                 stops, case % 5 == 0)
        at = fixed = 0  # fixed: the last update's end whose text ended in a whole character
        while at < len(ids):
            block = int(rng.integers(1, 33))
            at = min(len(ids), at + block)
            end = at == len(ids)
            reason = {"type": "stop", "matched": stops[0]} if end and stops else None
            del lengths[:]
            delta = fast.update(ids[:at], reason)
            assert (delta, fast.text) == slow(ids[:at], reason), (case, at)
            assert max(lengths) <= at - fixed + CONTEXT_TOKENS, (case, at, lengths)
            if not tok.decode(ids[:at], skip_special_tokens=skip).endswith("\ufffd"):
                fixed = at


def test_detokenizer_gives_the_whole_text_with_decoders_that_look_back() -> None:
    """A SentencePiece-style (Metaspace) decoder drops the first token's leading space, so a
    window decoded alone differs from the same tokens inside the whole output: the context
    before the new tokens keeps the deltas those of the whole text. A decoder whose text of a
    window never begins as the context's (here: it counts the tokens) makes every update
    decode the whole output, with the same deltas as before."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    words = ["▁the", "▁cat", "s", "▁sat", "▁", "ing", "<s>", "!"]
    meta = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    meta.decoder = decoders.Metaspace()

    def counting(ids: list[int]) -> str:
        return f"{len(ids)}:" + "".join(words[i] for i in ids)

    rng = np.random.default_rng(3)
    for decode in (lambda ids: meta.decode(ids), counting):
        for _ in range(100):
            ids = [int(i) for i in rng.integers(0, len(words), size=int(rng.integers(1, 60)))]
            fast = IncrementalDetokenizer(decode, ["▁sat"])
            slow = whole_text_update(decode, ["▁sat"], False)
            at = 0
            while at < len(ids):
                at = min(len(ids), at + int(rng.integers(1, 9)))
                reason = {"type": "length"} if at == len(ids) else None
                assert (fast.update(ids[:at], reason), fast.text) == slow(ids[:at], reason)


def test_a_stop_regex_is_searched_in_the_whole_text_decoded_where_it_grew() -> None:
    """A stop_regex may span the whole output, so each commit searches the whole text, but
    decodes only the new tokens and CONTEXT_TOKENS before them (the text is kept with the
    request): with the built-in model's tokenizer, random outputs in random blocks finish at
    the same token with the same match as decoding the whole output at every commit, and no
    decode before the finishing commit is longer than the tokens since the text last ended
    in a whole character and the context."""
    import regex

    from dllm_serve.default_model import default_model_path
    from dllm_serve.tokenizer import Tokenizer
    from dllm_serve.utils.text import CONTEXT_TOKENS

    tok = Tokenizer.load(str(default_model_path()))
    lengths: list[int] = []

    def decode(ids: list[int]) -> str:
        lengths.append(len(ids))
        return tok.decode(ids)

    rng = np.random.default_rng(4)
    pieces = [" Answer: 42", " Question", "\n\n", " apples", "日本", "é", " 7", " the"]
    patterns = [r"Answer: \d+", r"日本.*apples", r"Question\s+\d"]
    checker = FinishChecker(set(), decode)
    finished = 0
    for case in range(200):
        ids = tok.encode("".join(rng.choice(pieces, size=int(rng.integers(1, 80)))),
                         add_special_tokens=False)
        pattern = patterns[case % len(patterns)]
        fast = req(max_new_tokens=10_000, stop_regex=[pattern], ignore_eos=True)
        at = fixed = 0
        while at < len(ids) and not fast.finished:
            block = ids[at:at + int(rng.integers(1, 33))]
            at += len(block)
            del lengths[:]
            checker.commit(fast, np.asarray(block, dtype=np.int64))
            if not fast.finished:
                assert max(lengths) <= at - fixed + CONTEXT_TOKENS, (case, at, lengths)
            if not tok.decode(ids[:at]).endswith("\ufffd"):
                fixed = at
        first = next((n for n in range(1, len(ids) + 1)
                      if regex.search(pattern, tok.decode(ids[:n]))), None)
        assert len(fast.output_ids) == (first or len(ids)), (case, pattern)
        if first is not None:
            match = regex.search(pattern, tok.decode(ids[:first])).group(0)
            assert fast.finish_reason == {"type": "stop", "matched": match,
                                          "at": regex.search(pattern, tok.decode(
                                              ids[:first])).start()}
        finished += fast.finished
    assert 30 < finished < 200
