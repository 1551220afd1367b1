"""End to end on the real defaults: the app that `tokencache serve` builds with no options
(offline, the bundled SmolLM2-135M as the large model and its first 24 layers as the small one,
entropy router 0.5) answers a chat request through the openai client with exactly what
RoutedEngine.generate gives for the same prompt on the same models. One model load (~15 s)."""

from __future__ import annotations

from typing import Any

import openai
import torch

from tokencache_routing import EngineConfig, RoutedEngine
from tokencache_serve.cli import build_app, build_parser
from tokencache_serve.runner import BackgroundServer

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_NEW = 12


def test_default_server_matches_generate() -> None:
    threads = torch.get_num_threads()
    a = build_parser().parse_args(["serve", "--torch-threads", "1", "--num-slots", "1024"])
    try:
        app = build_app(a)
        server: Any = app.state.server
        eng, tok = server.engine, server.tokenizer
        assert eng.small.model.config.num_hidden_layers == 24
        assert eng.large.model.config.num_hidden_layers == 30
        # the same models and router in a second engine: the expected answer
        ref_eng = RoutedEngine(
            eng.small.model,
            eng.large.model,
            eng.router,
            config=EngineConfig(num_slots=1024, tokenizer=tok, eos_token_id=tok.eos_token_id),
        )
        text = tok.apply_chat_template(
            [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(text, add_special_tokens=False)
        ref = ref_eng.generate([ids], MAX_NEW)
        with BackgroundServer(app) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0)
            (model,) = client.models.list().data
            r = client.chat.completions.create(
                model=model.id,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=MAX_NEW,
                temperature=0,
            )
            x = r.choices[0].model_extra["tokencache"]
            assert x["token_ids"] == ref.tokens[0]
            assert x["large_token_mask"] == ref.models[0]
            answer = r.choices[0].message.content
            assert answer == tok.decode(ref.tokens[0], skip_special_tokens=True)
            assert "Paris" in answer
            assert r.usage.prompt_tokens == len(ids)
            assert 0 < sum(x["large_token_mask"]) < MAX_NEW  # both models wrote
            streamed = client.chat.completions.create(
                model=model.id,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=MAX_NEW,
                temperature=0,
                stream=True,
            )
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer
    finally:
        torch.set_num_threads(threads)
