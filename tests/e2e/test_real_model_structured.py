"""Structured output on the real default model: 50 schema-constrained chat requests at once all parse and
validate against their schema, and finish where their grammar ends.

Five bounded schemas (objects, enums, integers with ranges, strings with a maximum length, a fixed-length
array) times ten questions, submitted together from 50 threads through one batcher, sampled at temperature
0.7 with a seed each: whatever the model would have said, the grammar makes it valid JSON of its schema.
Tool calls with `tool_choice` required or named work on it too, though its template does not render tools.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.generation_types import GenerationParams, SamplingParams
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.structured import StructuredOutput

pytestmark = pytest.mark.real_model

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                  "minItems": 3, "maxItems": 3}},
     "required": ["colours"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"enum": ["low", "high"]}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "country": {"enum": ["France", "Japan", "Peru", "Kenya"]}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "maxItems": 2}},
     "required": ["rating", "tags"], "additionalProperties": False},
]
QUESTIONS = ["Describe a person.", "Pick some colours.", "Is the sky blue?", "Name a city.", "Rate a film.",
             "Tell me about Paris.", "Who won?", "Give me JSON.", "What do you like?", "Summarise your day."]


def test_fifty_concurrent_schema_constrained_requests_all_validate(real_model_dir, device):
    model = load_model(real_model_dir, device=device, dtype="float32")
    jobs = [(schema, question) for schema in SCHEMAS for question in QUESTIONS]
    results: list = [None] * len(jobs)
    with ContinuousBatcher.from_model(model, BatcherConfig.serving()) as batcher:
        start = threading.Barrier(len(jobs))

        def one(k: int) -> None:
            schema, question = jobs[k]
            ids = model.tokenizer.encode_chat([{"role": "user", "content": question + " Answer in JSON."}])
            params = GenerationParams(max_tokens=160, sampling=SamplingParams(temperature=0.7), seed=k,
                                      structured=StructuredOutput.json_schema(schema))
            start.wait(60)
            try:
                results[k] = batcher.generate(ids, params, model.tokenizer.stop_tokens)
            except BaseException as error:  # judged below
                results[k] = error

        threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
            assert not t.is_alive()
    for (schema, question), result in zip(jobs, results):
        assert not isinstance(result, BaseException), (question, result)
        assert result.finish_reason.kind == "stop", (question, result.text)
        jsonschema.validate(json.loads(result.text), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                   "required": ["zone"], "additionalProperties": False}}}


def test_tools_required_or_named_work_on_the_default_model(real_model_dir, device):
    """SmolLM2's chat template does not render tools: they are described in a system message, and the
    grammar forces a call whatever the model would have written, over HTTP through the official client,
    whole and streamed (the arguments arriving as deltas)."""
    from server_helpers import MODEL_NAME, openai_client, served

    model = load_model(real_model_dir, device=device, dtype="float32")
    assert not model.tokenizer.supports_tools
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    with served(ContinuousBatcher.from_model(model, BatcherConfig.serving())) as (base_url, _app), \
            openai_client(base_url, timeout=120) as client:
        required = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER, CLOCK],
                                                  tool_choice="required", max_tokens=120, temperature=0)
        named = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER, CLOCK],
                                               max_tokens=120, temperature=0.7, seed=1,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}})
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER, CLOCK],
                                                tool_choice="required", max_tokens=120, temperature=0, stream=True)
        arguments, pieces = {}, 0
        for chunk in stream:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
                pieces += bool(delta.function.arguments)
    assert required.choices[0].finish_reason == "tool_calls"
    for call in required.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    assert pieces > len(arguments) > 0
    first = required.choices[0].message.tool_calls[0]
    assert json.loads(arguments[0]) == json.loads(first.function.arguments)
