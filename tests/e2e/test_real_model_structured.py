"""Structured output on the real default model: 50 schema-constrained chat requests at once all parse and
validate against their schema, and finish where their grammar ends.

Five bounded schemas (objects, enums, integers with ranges, strings with a maximum length, a fixed-length
array) times ten questions, submitted together from 50 threads through one batcher, sampled at temperature
0.7 with a seed each: whatever the model would have said, the grammar makes it valid JSON of its schema.
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
