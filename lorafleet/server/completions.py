"""POST /v1/completions and /v1/chat/completions: parse, admit, hand the prompts to the engine
thread, then answer whole or stream as server-sent events.

A request's life here: the body is decoded and parsed (a 400 naming the field; more prompts than
the daemon ever admits is a 400 too, since no retry could succeed) -> `ServerState.admit`
(429/503 instead of an unbounded queue) -> tokenization on a worker thread (never on the event
loop, never on the engine thread) -> one engine request per prompt, all feeding one `Sink` ->
a `Run` that reads the sink -> `Run.close()`,
which always runs (finished, client gone, error or shutdown) and aborts whatever the engine
still holds for it. A client that hangs up is noticed at once (uvicorn reports the disconnect),
so its request is aborted before the engine's next step and its pages are freed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lorafleet.errors import (AdapterError, AdapterNotFoundError, InvalidRequestError, LorafleetError,
                              RequestFailedError, shown)
from lorafleet.adapters.mix import Mix
from lorafleet.model import tool_calls
from lorafleet.server import renders, responses, tools
from lorafleet.server.errors import error_body
from lorafleet.server.protocol import (DECODE_ON_WORKER, Generation, bad, decode_body, parse_chat, parse_completion,
                                       tokenize)
from lorafleet.server.state import ServerState
from lorafleet.server.worker import Sink

router = APIRouter()


async def read_json(request: Request, parse=None, *args, max_text_bytes: int | None = None):
    """The body as JSON (its size is capped by the app's `max_body_size` before it gets here), or `parse(json,
    *args)` of it: decoded and parsed on a worker thread when it is over DECODE_ON_WORKER bytes,
    so that a large body never holds the event loop; a string longer than `max_text_bytes` of
    text is refused unparsed."""
    raw = await request.body()
    def work():
        body = decode_body(raw, max_text_bytes)
        return parse(body, *args) if parse is not None else body
    return await asyncio.to_thread(work) if len(raw) > DECODE_ON_WORKER else work()


def state_of(request: Request) -> ServerState:
    return request.app.state.lorafleet


@router.post("/v1/completions")
async def completions(request: Request):
    st = state_of(request)
    gen = await read_json(request, parse_completion, st.base_name, st.sampling_defaults,
                          max_text_bytes=st.max_text_bytes)
    if len(gen.prompts) > st.config.max_pending:
        raise bad("prompt", f"{len(gen.prompts)} prompts in one request; the daemon admits at most "
                            f"{st.config.max_pending} at once (`serve --max-pending`): split the request")
    return await generate(request, st, gen, "cmpl")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    st = state_of(request)
    gen = await read_json(request, parse_chat, st.base_name, st.sampling_defaults, max_text_bytes=st.max_text_bytes)
    return await generate(request, st, gen, "chatcmpl")


def pull_hint(st: ServerState, name: str) -> str:
    """How an adapter of that name could come to exist here (nothing for a name no adapter can have,
    and no pull for one the store cannot hold)."""
    from lorafleet.store.store import NAME_RE

    if len(name) > 128:
        return ""
    if not NAME_RE.match(name) or ".." in name:
        return "; load one under that name with POST /v1/load_lora_adapter"
    if st.worker.resolver is not None:
        return (f"; to serve an adapter under that name, store it with `lorafleet pull SOURCE --name {name}` "
                "(the daemon serves stored adapters on their first request)")
    return "; load one with POST /v1/load_lora_adapter (this daemon does not serve the store)"


async def generate(request: Request, st: ServerState, gen: Generation, prefix: str):
    n = 1 if gen.kind == "chat" else len(gen.prompts)
    st.admit(n)
    run = Run(st, gen, n, f"{prefix}-{uuid.uuid4().hex}")
    try:
        gen, tokenizer = await prepare_request(st, gen)
        run.gen, run.text, run.with_ids = gen, responses.token_text_of(tokenizer), tokenizer is None
        for rid, prompt in zip(run.ids, gen.prompts):
            run.unfinished.add(rid)  # before the await: if we are cancelled there, close() aborts it
            await asyncio.wrap_future(st.worker.submit(prompt, gen.params, gen.adapter, rid, run.sink, gen.grammar))
    except AdapterNotFoundError as missing:
        run.close()
        store = ", nor in the store" if st.worker.resolver is not None else ""
        if isinstance(gen.adapter, Mix):
            name = getattr(missing, "adapter", None) or gen.adapter.label
            e = AdapterNotFoundError(f"adapters: adapter {shown(name)} is not a loaded adapter{store} "
                                     f"(GET /v1/models lists them){pull_hint(st, name)}")
            e.code, e.param = "model_not_found", "adapters"
        else:
            e = AdapterNotFoundError(f"model {shown(gen.model)} does not exist: it is neither the base "
                                     f"({st.base_name!r}) nor a loaded adapter{store} (GET /v1/models lists them)"
                                     f"{pull_hint(st, gen.model)}")
            e.code, e.param = "model_not_found", "model"
        raise e from None
    except BaseException:
        run.close()
        raise
    if gen.stream:
        return EventStream(run)
    return await run.collect(request)


async def prepare_request(st: ServerState, gen: Generation) -> tuple[Generation, object]:
    """The request made whole before the engine sees it, off the engine thread and the event
    loop: its stored adapters registered (`tokenizer_of`), its tokenizer chosen once, its chat
    rendered (`renders`: in processes, bounded), its tools' format read, its structured output (or forced tool
    call) compiled and its prompts tokenized. The engine thread
    only queues what comes out (`EngineWorker.submit`). Returns it with its tokenizer."""
    tokenizer = await tokenizer_of(st, gen)
    if gen.tools is not None:  # its format read off the template; a required or named call made a grammar
        template = tokenizer.chat_template if tokenizer is not None else None
        gen.tool_format, gen.params = tools.prepare(gen.tools, template, gen.params, tokenizer)
    if gen.params.structured is not None:  # compiled off the loop: the matcher build drops the GIL
        gen.grammar = await asyncio.to_thread(st.worker.engine.grammar, gen.params.structured, gen.adapter)
    rendered = await renders.render_chat(gen, tokenizer, st.max_model_len) if gen.kind == "chat" else None
    return await asyncio.to_thread(tokenize, gen, tokenizer, st.max_model_len, rendered), tokenizer


async def tokenizer_of(st: ServerState, gen: Generation):
    """The request's tokenizer: its adapter's own where it has its own vocabulary, else the
    base's (`Engine.tokenizer_for`). Stored adapters are resolved first, their files checked on a
    worker (`StoreResolver.prepare`), so that the engine thread only records them and a first
    request is read with its adapter's own tokenizer too."""
    engine, resolver = st.worker.engine, st.worker.resolver
    names = getattr(gen.adapter, "names", None) or ([gen.adapter] if gen.adapter is not None else [])
    for name in names if resolver is not None else ():
        prepared = await asyncio.to_thread(resolver.prepare, engine, name)
        if prepared is not None:
            await asyncio.wrap_future(st.worker.call(functools.partial(resolver.install, name=name, prepared=prepared)))
    return engine.tokenizer_for(gen.adapter)


# why the engine ended a request, by its error code: an adapter that could not load; a mix found
# invalid once its adapters' kinds were known (DoRA, lora_bias: `engine.mixes.mixable`), a 400
_ENDED = {AdapterError.code: AdapterError, InvalidRequestError.code: InvalidRequestError}


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Run:
    """The engine requests behind one HTTP request, and their outputs as they arrive."""

    def __init__(self, st: ServerState, gen: Generation, n: int, rid: str):
        self.st, self.gen, self.rid = st, gen, rid
        self.ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        self.index = {r: i for i, r in enumerate(self.ids)}
        self.sink = Sink(asyncio.get_running_loop())
        self.unfinished: set[str] = set()
        self.finals: dict[str, object] = {}  # each request's final output: its whole answer
        self.streamed: dict[str, int] = {}     # characters each request has streamed so far
        self.created = int(time.time())
        # the request's tokenizer's `token_text_of` and whether it has none (chunks and choices then
        # carry token ids), both set once it is known (`generate`)
        self.text, self.with_ids = responses.token_text_of(None), True
        self._closed = False
        st.runs.add(self)

    async def next(self):
        item = await self.sink.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
            self.finals[item.request_id] = item
            if item.finish_reason == "error":  # the engine could not serve it: it alone failed
                error = _ENDED.get(item.error_code, RequestFailedError)(item.error)
                if isinstance(error, InvalidRequestError):
                    error.param = "adapters"  # the one late refusal: a mix (`engine.mixes.mixable`)
                raise error
        return item

    def close(self) -> None:
        """Abort what the engine still holds for this request and give back its admission."""
        if self._closed:
            return
        self._closed = True
        self.st.runs.discard(self)
        for rid in self.unfinished:
            self.st.worker.abort(rid)
        self.st.release(len(self.ids))

    def outputs(self) -> list:
        return [self.finals[r] for r in self.ids]

    async def collect(self, request: Request) -> Response:
        async def all_finished():
            while self.unfinished:
                await self.next()
        work = asyncio.ensure_future(all_finished())
        watch = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client hung up: nobody to answer
                self.st.num_disconnects += 1
                return Response(status_code=499)
            work.result()
            return JSONResponse(responses.response(self.gen, self.rid, self.created, self.outputs(), self.text,
                                                   self.with_ids))
        finally:
            for task in (work, watch):
                task.cancel()
            self.close()

    async def events(self):
        """The SSE body: chunks as tokens arrive, an error event if the engine fails, [DONE]."""
        gen = self.gen
        if gen.kind == "chat":
            yield sse(responses.first_chat_chunk(gen, self.rid, self.created))
        calls = tool_calls.ToolStream(gen.tool_format, gen.tools.names) if gen.tools and gen.tool_format else None
        while self.unfinished:
            try:
                out = await self.next()
            except LorafleetError as e:
                yield sse({"error": error_body(e)["error"]})
                break
            if calls is not None:
                for c in responses.tool_chunks(gen, self.rid, self.created, calls, out, self.text, self.with_ids):
                    yield sse(c)
                continue
            if not (out.new_text or out.finished or (out.new_token_ids and (gen.logprobs is not None or self.with_ids))):
                continue
            offset = self.streamed.get(out.request_id, 0)
            self.streamed[out.request_id] = offset + len(out.new_text)
            yield sse(responses.chunk(gen, self.rid, self.created, self.index[out.request_id], out,
                                      self.text, offset, self.with_ids))
        else:
            if gen.include_usage:
                yield sse(responses.usage_chunk(gen, self.rid, self.created, self.outputs()))
        yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Streams a Run; whatever ends the stream (done, client gone, cancelled), the Run closes."""

    def __init__(self, run: Run):
        super().__init__(run.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.run.unfinished:
                self.run.st.num_disconnects += 1
            self.run.close()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
