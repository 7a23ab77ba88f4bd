"""Incremental detokenization on the embedded model's tokenizer."""

from __future__ import annotations

import pytest

from tests.support.eventually import eventually
from tests.support.grpc_fakes import FakeContext
from vmesh.services.common.types import OutputMode, SamplingParams
from vmesh.services.detokenizer.incremental import IncrementalDetokenizer
from vmesh.services.detokenizer.output_processor import OutputProcessor


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer.backend_tokenizer


def stream(tok, ids, params, per_step=1, finish=True):
    detok = IncrementalDetokenizer(tok, params, prompt_token_ids=[1, 9690, 198])
    outs = []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        out = detok.update(ids[i:i + per_step], finished=finish and last)
        outs.append(out)
        if out.stop_hit:
            break
    return outs


@pytest.mark.parametrize("text", ["Hello 😀🎉 world", "世界你好，天气很好。", "naïve café 🇫🇷 — ok",
                                  "emoji 👩‍👩‍👧 family"])
def test_multibyte_characters_stream_as_valid_deltas(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    # Some character spans several byte-level tokens, so partial sequences must be held.
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "test text should split characters across tokens"
    outs = stream(tok, ids, SamplingParams())
    assert all("\ufffd" not in o.text for o in outs)
    assert "".join(o.text for o in outs) == tok.decode(ids) == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_stops_exactly(tok, include):
    text = "The answer is forty-two, said the computer."
    ids = tok.encode(text, add_special_tokens=False).ids
    stop = "forty-two"
    boundaries = {len(tok.decode(ids[:i])) for i in range(len(ids) + 1)}
    start = text.index(stop)
    assert any(start < b < start + len(stop) for b in boundaries), "stop string should span tokens"
    outs = stream(tok, ids, SamplingParams(stop=[stop], include_stop_str_in_output=include), finish=False)
    assert outs[-1].stop_hit and outs[-1].finished
    expected = text[:start + len(stop)] if include else text[:start]
    assert "".join(o.text for o in outs) == expected
    # Text that could still become the stop string was never sent early.
    sent = ""
    for o in outs[:-1]:
        sent += o.text
        assert not sent.endswith("forty")


def test_held_back_text_is_released_when_no_stop_follows(tok):
    text = "I like forty cats and forty-one dogs."
    ids = tok.encode(text, add_special_tokens=False).ids
    outs = stream(tok, ids, SamplingParams(stop=["forty-two"]))
    assert not any(o.stop_hit for o in outs)
    assert "".join(o.text for o in outs) == text


def test_stop_strings_only_count_after_min_tokens(tok):
    text = "stop here, then more text and stop again"
    ids = tok.encode(text, add_special_tokens=False).ids
    outs = stream(tok, ids, SamplingParams(stop=["stop"], min_tokens=3), finish=False)
    assert outs[-1].stop_hit
    assert "".join(o.text for o in outs) == "stop here, then more text and "


def test_special_tokens_skipped_or_kept(tok):
    ids = [*tok.encode("Hi there", add_special_tokens=False).ids, 2]  # <|im_end|>
    skipped = "".join(o.text for o in stream(tok, ids, SamplingParams(skip_special_tokens=True)))
    kept = "".join(o.text for o in stream(tok, ids, SamplingParams(skip_special_tokens=False)))
    assert skipped == "Hi there"
    assert kept == "Hi there<|im_end|>"


def test_output_modes(tok):
    ids = tok.encode("one two three", add_special_tokens=False).ids
    delta = [o.text for o in stream(tok, ids, SamplingParams(output_mode=OutputMode.DELTA))]
    cumulative = [o.text for o in stream(tok, ids, SamplingParams(output_mode=OutputMode.CUMULATIVE))]
    final = [o.text for o in stream(tok, ids, SamplingParams(output_mode=OutputMode.FINAL_ONLY))]
    assert "".join(delta) == "one two three"
    assert cumulative[-1] == "one two three" and all(cumulative[-1].startswith(c) for c in cumulative)
    assert final[:-1] == [""] * (len(final) - 1) and final[-1] == "one two three"


def test_a_closed_scheduler_stream_fails_its_requests_toward_their_frontends(tok):
    import asyncio

    from vmesh.services.detokenizer.server import DetokenizerServicer
    from vmesh.v1 import common_pb2, detokenizer_pb2

    async def scheduler_stream():
        yield detokenizer_pb2.DetokenizeRequest(
            new_requests=[detokenizer_pb2.DetokenizerRequestInfo(handle=7, frontend_id="f", frontend_key=3,
                                                                 num_prompt_tokens=2)],
            handles=[7], num_tokens=[1], token_ids=[9690], finish_reasons=[0], num_cached_prompt_tokens=[0],
            errors=[""])
        raise ConnectionError("the scheduler went away")

    async def main() -> list:
        servicer = DetokenizerServicer(tok)
        servicer.subscribers["f"] = queue = asyncio.Queue()
        with pytest.raises(ConnectionError):
            async for _ in servicer.Detokenize(scheduler_stream(), FakeContext()):
                pass
        assert servicer.num_requests == 0
        return [queue.get_nowait() for _ in range(queue.qsize())]

    first, last = asyncio.run(main())
    assert list(first.frontend_keys) == [3] and list(first.errors) == [""]
    assert list(last.frontend_keys) == [3] and "closed" in last.errors[0]
    assert list(last.finish_reasons) == [common_pb2.FINISH_REASON_ABORT]
    assert list(last.resumable) == [True], "a lost scheduler's requests may fail over"


def test_draining_tells_open_and_new_scheduler_streams():
    import asyncio

    from vmesh.services.detokenizer.server import DetokenizerServicer

    async def idle_scheduler(closed: asyncio.Event):
        await closed.wait()
        return
        yield

    async def first_reply(servicer, closed) -> object:
        stream = servicer.Detokenize(idle_scheduler(closed), FakeContext())
        return await stream.__anext__(), stream

    async def main() -> tuple:
        servicer = DetokenizerServicer(None)
        closed = asyncio.Event()
        open_stream = asyncio.create_task(first_reply(servicer, closed))
        await eventually(lambda: servicer.streams)
        servicer.start_draining()
        old, old_stream = await asyncio.wait_for(open_stream, 5)
        new, new_stream = await asyncio.wait_for(first_reply(servicer, closed), 5)
        closed.set()  # the scheduler ends both streams
        for stream in (old_stream, new_stream):
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        return old, new, servicer.streams

    old, new, streams = asyncio.run(main())
    assert old.draining and new.draining and not old.stopped_handles
    assert streams == []


def test_a_frontend_whose_subscription_ends_has_its_requests_stopped(tok):
    import asyncio

    from vmesh.services.detokenizer.server import DetokenizerServicer
    from vmesh.v1 import detokenizer_pb2

    def introduce(handle: int, frontend_id: str) -> detokenizer_pb2.DetokenizeRequest:
        return detokenizer_pb2.DetokenizeRequest(new_requests=[detokenizer_pb2.DetokenizerRequestInfo(
            handle=handle, frontend_id=frontend_id, frontend_key=handle, num_prompt_tokens=2)])

    async def main() -> detokenizer_pb2.DetokenizeResponse:
        servicer = DetokenizerServicer(tok)
        batches: asyncio.Queue = asyncio.Queue()

        async def scheduler():
            while (batch := await batches.get()) is not None:
                yield batch

        subscriptions = {f: servicer.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id=f), FakeContext())
                         for f in ("gone", "staying")}
        pending = {f: asyncio.ensure_future(s.__anext__()) for f, s in subscriptions.items()}
        await eventually(lambda: len(servicer.subscribers) == 2)
        stream = servicer.Detokenize(scheduler(), FakeContext())
        reply = asyncio.ensure_future(stream.__anext__())
        for handle, frontend_id in ((1, "gone"), (2, "staying"), (3, "gone")):
            batches.put_nowait(introduce(handle, frontend_id))
        await eventually(lambda: servicer.num_requests >= 3)
        pending["gone"].cancel()  # the frontend's subscription breaks
        await asyncio.gather(pending["gone"], return_exceptions=True)
        response = await asyncio.wait_for(reply, 5)
        assert servicer.num_requests == 1 and "gone" not in servicer.subscribers
        batches.put_nowait(None)
        pending["staying"].cancel()
        await asyncio.gather(pending["staying"], return_exceptions=True)
        return response

    response = asyncio.run(main())
    assert sorted(response.orphaned_handles) == [1, 3]


@pytest.mark.parametrize("mode", list(OutputMode))
@pytest.mark.parametrize("text", ["Hello 😀🎉 world, and so on", "Say STOP-ish things, then STOP now."])
def test_a_resumed_request_continues_the_text_without_gap_or_duplicate(tok, mode, text):
    """A replica takes over at every point of a stream (the client had what the old one sent,
    with text held back for a stop string or an unfinished character): the new replica's
    outputs continue it exactly."""
    ids = tok.encode(text, add_special_tokens=False).ids
    params = SamplingParams(stop=["STOP now"], output_mode=mode)
    undisturbed = stream(tok, ids, params)
    ids = ids[:len(undisturbed)]  # the tokens up to the stop string's end
    for cut in range(1, len(ids)):
        old = IncrementalDetokenizer(tok, params, prompt_token_ids=[1, 9690, 198])
        seen = [old.update(ids[i:i + 1]).text for i in range(cut)]
        # What the client has: every delta, or the latest whole text (nothing in final-only mode).
        delivered = "".join(seen) if mode is OutputMode.DELTA else seen[-1]
        new = IncrementalDetokenizer(tok, params, prompt_token_ids=[1, 9690, 198])
        new.resume(ids[:cut], len(delivered))
        rest = [new.update(ids[i:i + 1], finished=i == len(ids) - 1) for i in range(cut, len(ids))]
        if mode is OutputMode.DELTA:
            assert delivered + "".join(o.text for o in rest) == "".join(o.text for o in undisturbed)
        else:
            assert rest[-1].text == undisturbed[-1].text
        assert [o.stop_hit for o in rest] == [o.stop_hit for o in undisturbed[cut:]]


def test_a_replica_introduced_to_a_resumed_request_counts_its_earlier_tokens(tok):
    import asyncio

    from vmesh.services.detokenizer.server import DetokenizerServicer
    from vmesh.v1 import common_pb2, detokenizer_pb2

    earlier = tok.encode("Hello there", add_special_tokens=False).ids
    servicer = DetokenizerServicer(tok)
    servicer.subscribers["f"] = queue = asyncio.Queue()
    servicer.process(detokenizer_pb2.DetokenizeRequest(
        new_requests=[detokenizer_pb2.DetokenizerRequestInfo(
            handle=1, frontend_id="f", frontend_key=4, num_prompt_tokens=2, prompt_tail=[1, 9690, 198],
            resumed_output_token_ids=earlier, resumed_text_length=len("Hello"))],
        handles=[1], num_tokens=[1], token_ids=tok.encode(" friend", add_special_tokens=False).ids[:1],
        finish_reasons=[common_pb2.FINISH_REASON_LENGTH], num_cached_prompt_tokens=[0], errors=[""]),
        OutputProcessor(tok))
    out = queue.get_nowait()
    assert out.texts[0] == " there friend"  # only what the client lacks
    assert out.num_output_tokens[0] == len(earlier) + 1 and out.num_prompt_tokens[0] == 2


def test_a_request_introduced_after_its_frontend_left_is_reported_orphaned(tok):
    """Queued when its frontend died, it reaches the replica only once admitted: the replica,
    which the frontend subscribed to before submitting, knows the frontend is gone."""
    import asyncio

    from vmesh.services.detokenizer.server import DetokenizerServicer
    from vmesh.v1 import detokenizer_pb2

    servicer = DetokenizerServicer(tok)
    servicer.subscribers["alive"] = asyncio.Queue()
    requests: OutputProcessor[int] = OutputProcessor(tok)
    reply = servicer.process(detokenizer_pb2.DetokenizeRequest(
        new_requests=[detokenizer_pb2.DetokenizerRequestInfo(handle=1, frontend_id="gone", frontend_key=1),
                      detokenizer_pb2.DetokenizerRequestInfo(handle=2, frontend_id="alive", frontend_key=2)],
        handles=[1, 2], num_tokens=[1, 1], token_ids=[9690, 9690], finish_reasons=[0, 0],
        num_cached_prompt_tokens=[0, 0], errors=["", ""]), requests)
    assert list(reply.orphaned_handles) == [1] and list(requests) == [2]
    assert servicer.subscribers["alive"].qsize() == 1
