"""POST /tokenize and POST /detokenize, with vLLM's request and response bodies.

{"prompt": "Hello"}                      -> {"tokens": [...], "count": n, "max_model_len": m}
{"messages": [{"role": ..., ...}]}       -> the same, through the chat template
{"tokens": [1, 2, 3]}                    -> {"prompt": "..."}
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from server.cpu_work import check_prompt_chars
from server.errors import invalid
from server.protocol import DetokenizeRequest, TokenizeRequest, check_token_ids
from server.guided import chat_messages
from server.serving_chat import encode_chat
from server.serving_common import parse_request


async def tokenize(request: Request) -> JSONResponse:
    state, engine, body = await parse_request(request, TokenizeRequest)
    assert state.limits is not None  # attach()ed, as the engine is
    if (body.prompt is None) == (body.messages is None):
        raise invalid("Give exactly one of 'prompt' or 'messages'", param="prompt")
    if body.prompt is not None:
        check_prompt_chars(body.prompt, state.max_prompt_chars, state.limits.max_model_len, "prompt")
        tokens = await state.off_loop(engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        messages, tools = chat_messages(body, engine.tokenizer)
        tokens = await state.off_loop(
            encode_chat,
            engine.tokenizer,
            messages,
            body.add_generation_prompt,
            tools=tools,
            max_chars=state.max_prompt_chars,
            max_model_len=state.limits.max_model_len,
        )
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.limits.max_model_len})


async def detokenize(request: Request) -> JSONResponse:
    state, engine, body = await parse_request(request, DetokenizeRequest)
    assert state.limits is not None  # attach()ed, as the engine is
    check_token_ids(body.tokens, state.limits.vocab_size, "tokens")
    return JSONResponse({"prompt": await state.off_loop(engine.tokenizer.decode, body.tokens)})
