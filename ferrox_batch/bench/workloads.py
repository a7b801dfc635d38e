"""The prompts and request shapes the batcher benchmark (`bench.batcher`) runs, its statistics helpers, and the two transformers peers.

Every method in a run gets exactly the same requests: the same prompt token ids
(from our tokenizer) and the same number of new tokens. The ids come from one
token stream, the 40 texts below in order; request i starts at text i % 40 and,
for every further lap through the texts, a few tokens later, so no two
requests share a prefix (a prefix cache, such as transformers' block sharing,
gets no free hits) and the stream wraps round when a request needs more. Shape (c) is the opposite: a
multi-turn chat whose prompts share a system prompt and extend each other; its texts are below, its plan,
prompts and closed-loop driver in `bench.conversations`.
"""

from __future__ import annotations

import itertools
import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PROMPTS = [
    "The lighthouse keeper had not spoken to another person in eleven weeks. Each morning he climbed the spiral stairs, wiped the salt from the great lens, and wrote the weather in a ledger that nobody would read.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Shopping list for the week:\n- two loaves of rye bread\n- a dozen eggs\n- spinach, carrots and three onions\n- olive oil (the big bottle)\n- coffee beans, dark roast\n- something for Sunday dessert",
    "Alice: Did you remember to book the train tickets?\nBob: I thought you were doing that.\nAlice: I said I would do the hotel.\nBob: Right. I'll look now. Oh no, the morning train is already full.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split, oxygen is released, and the energy captured is used to fix carbon dioxide into sugars through the Calvin cycle.",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\nLEFT JOIN orders ON orders.customer_id = customers.id\nWHERE orders.created_at >= '2023-01-01'\nGROUP BY customers.name\nORDER BY order_count DESC\nLIMIT 10;",
    "Dear Ms. Okafor,\n\nThank you for your letter of the 3rd. I am pleased to confirm that the committee has approved your proposal, subject to the small changes we discussed on the phone last Tuesday.",
    "Top five reasons to learn a second language:\n1. It opens doors when you travel.\n2. It sharpens your memory.\n3. You can read books in the original.\n4. It helps your career.\n5. It is simply fun.",
    "In 1869 the first transcontinental railroad in the United States was completed when the last spike was driven at Promontory Summit, Utah, joining the Central Pacific and Union Pacific lines.",
    "fn main() {\n    let words = vec![\"apple\", \"banana\", \"cherry\"];\n    for (i, w) in words.iter().enumerate() {\n        println!(\"{}: {}\", i, w.to_uppercase());\n    }\n}\n",
    "Customer: Hi, my order arrived damaged.\nAgent: I'm sorry to hear that. Could you give me the order number?\nCustomer: It's 48213.\nAgent: Thank you. I can send a replacement today or refund you in full.",
    "The recipe is simple. Melt the butter in a heavy pan, add the flour and stir for two minutes. Pour in the warm milk a little at a time, whisking all the while, until the sauce is smooth and thick.",
    "Meeting notes, Tuesday:\n* Budget review postponed to Friday\n* Marta to draft the hiring plan\n* The new office lease starts in March\n* Open question: who owns the customer survey?",
    "The old city wall ran along the river for almost two miles. Parts of it were still standing, covered in ivy, and children climbed the crumbling towers on summer evenings while their parents watched from the bridge.",
    "#include <stdio.h>\n\nint main(void) {\n    int sum = 0;\n    for (int i = 1; i <= 100; i++) {\n        if (i % 3 == 0 || i % 5 == 0) sum += i;\n    }\n    printf(\"%d\\n\", sum);\n    return 0;\n}\n",
    "Q: What is the difference between weather and climate?\nA: Weather is what happens in the atmosphere over hours or days. Climate is the average pattern of weather in a place over many years.",
    "Packing checklist for the hiking trip: tent, sleeping bag, stove and fuel, two litres of water per person, a map and compass, first-aid kit, rain jacket, warm hat, headlamp with spare batteries.",
    "She opened the letter slowly, as if the words inside might escape. The handwriting was her grandmother's, small and slanted, and the first line said only: I should have told you this years ago.",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n    def pop(self):\n        if not self._items:\n            raise IndexError('pop from empty stack')\n        return self._items.pop()\n",
    "Teacher: Who can tell me what a prime number is?\nStudent: A number that can only be divided by one and itself?\nTeacher: Good. Is one a prime number?\nStudent: Hmm. I think so?\nTeacher: Actually, no.",
    "The committee found that the bridge had been inspected every two years as required, but that the inspections had not included the underwater supports, where most of the corrosion was later discovered.",
    "Steps to reset the router:\n1. Unplug the power cable.\n2. Wait thirty seconds.\n3. Hold the reset button while plugging it back in.\n4. Release after ten seconds.\n5. Connect to the default network.",
    "Volcanoes form where magma rises through the crust. Some erupt explosively, throwing ash high into the atmosphere, while others release slow rivers of lava that can flow for weeks before cooling into new rock.",
    "const fetchUser = async (id) => {\n  const res = await fetch(`/api/users/${id}`);\n  if (!res.ok) throw new Error(`HTTP ${res.status}`);\n  const data = await res.json();\n  return { id: data.id, name: data.name };\n};\n",
    "Mother: Have you finished your homework?\nSon: Almost.\nMother: What does almost mean?\nSon: It means I have started.\nMother: Then the video games can wait until you have finished.",
    "The annual report shows revenue up eight percent, driven mainly by the services division. Costs rose faster than expected because of higher energy prices, so operating margin fell slightly to twelve percent.",
    "Ingredients: 200 g dark chocolate, 100 g butter, 3 eggs, 150 g sugar, 50 g flour, a pinch of salt. Oven: 180 C. Bake for 25 minutes, until the top cracks but the middle still wobbles.",
    "It rained for the whole of the festival. The stages sank into the mud, the tents leaked, and yet on the last night thousands of people stood in the downpour and sang along to every song as if it were midsummer.",
    "import numpy as np\n\ndef normalize(x, eps=1e-8):\n    mean = x.mean(axis=0)\n    std = x.std(axis=0)\n    return (x - mean) / (std + eps)\n\ndata = np.random.rand(100, 3)\nprint(normalize(data).std(axis=0))\n",
    "Interviewer: Why do you want this job?\nCandidate: I have been using your software for five years and I keep thinking of ways to make it better.\nInterviewer: Name one.\nCandidate: The search is far too slow.",
    "Glaciers move because ice under great pressure behaves like a very thick liquid. A large glacier can advance several metres a day, carving valleys, carrying boulders for hundreds of kilometres and leaving them behind.",
    "Things I learned this year:\n- Sleep matters more than any productivity trick.\n- Most meetings could be emails.\n- Write things down.\n- Call your friends.\n- A short walk fixes a surprising number of problems.",
    "The museum's newest exhibit traces the history of timekeeping, from sundials and water clocks through the pendulum clocks of the seventeenth century to the atomic clocks that now define the second.",
    "<html>\n  <body>\n    <h1>Welcome</h1>\n    <ul id=\"menu\">\n      <li><a href=\"/\">Home</a></li>\n      <li><a href=\"/about\">About</a></li>\n    </ul>\n  </body>\n</html>\n",
    "Pilot: Tower, this is flight two-one-seven requesting permission to land.\nTower: Two-one-seven, runway two-seven left is clear, wind two-six-zero at eight knots.\nPilot: Cleared to land, two-seven left.",
    "When the power failed, the whole street went quiet. Without the hum of fridges and televisions, people came out onto their doorsteps, lit candles, and talked to neighbours they had only ever nodded to before.",
    "Project timeline:\nPhase 1 (January): requirements and design.\nPhase 2 (February to April): build the core service.\nPhase 3 (May): testing with pilot users.\nPhase 4 (June): launch and support.",
    "Honeybees communicate the location of flowers with a waggle dance. The angle of the dance shows the direction relative to the sun, and the length of the waggle tells the other bees how far they must fly.",
    "git checkout -b fix/login-timeout\ngit add src/auth/session.py tests/test_session.py\ngit commit -m \"Extend session timeout and add a regression test\"\ngit push origin fix/login-timeout\n",
    "Grandfather: In my day we walked to school, uphill both ways.\nGranddaughter: That is not physically possible.\nGrandfather: It was a very strange hill.\nGranddaughter: You say that every time.",
]


# Shape (c), multi-turn chat (`bench.conversations` builds and drives it): every conversation shares this
# system prompt (297 tokens with the default model's tokenizer), opens with its own OPENERS entry and follows
# up with FOLLOW_UPS, each user turn padded to its drawn length with background from PROMPTS.
SYSTEM_PROMPT = (
    "You are Ferrox, a careful and friendly assistant in the internal help chat of a small software company. "
    "You help employees and customers with programming questions, writing, planning and everyday problems. "
    "Follow these guidelines in every conversation.\n\n"
    "1. Be accurate. If you are not sure of a fact, say so plainly instead of guessing, and suggest how the user "
    "could check it. Never invent citations, file names, commands or numbers.\n"
    "2. Be concise. Answer the question that was asked first, in a few sentences, then add detail only where it "
    "helps. Prefer short paragraphs and simple lists to long blocks of text.\n"
    "3. Be practical. When the user asks how to do something, give concrete steps they can follow, with a short "
    "example where it helps. For code, use the language the user is working in, keep examples small and "
    "runnable, and explain any line that is not obvious.\n"
    "4. Be safe. Do not help with anything that could hurt people, damage systems or break the law. Politely "
    "refuse such requests and, where you can, offer a safer alternative.\n"
    "5. Keep context. Remember what the user told you earlier in the conversation, refer back to it when it "
    "matters, and ask one short clarifying question when a request is ambiguous.\n"
    "6. Stay polite and calm, even when the user is frustrated. Use plain English, avoid jargon unless the user "
    "uses it first, and never make fun of a question."
)
OPENERS = [
    "How do I read a large CSV file in Python without running out of memory?",
    "Can you help me plan a three-day trip to Lisbon on a small budget?",
    "What is the difference between a process and a thread?",
    "My sourdough bread comes out flat. What am I doing wrong?",
    "How should I prepare for an interview for a junior data analyst role?",
    "Explain how HTTPS keeps my connection private.",
    "What are good habits for writing clear commit messages?",
    "I want to start running. How should I build up over the first month?",
    "How does a hash table handle two keys that land in the same bucket?",
    "Can you suggest a simple weekly meal plan for two people?",
    "Why does my SQL query get slower as the table grows?",
    "What should I check before buying a used bicycle?",
    "How do I write a polite email asking my manager for a raise?",
    "What is a good way to learn the basics of music theory?",
    "How can I make our team's weekly meeting shorter and more useful?",
    "What causes the seasons on Earth?",
]
FOLLOW_UPS = [
    "Can you give me a concrete example?", "What is the most common mistake people make here?",
    "How would you explain that to a complete beginner?", "Could you turn that into a short checklist?",
    "What would change if I only had half the time?", "Which of those steps matters most, and why?",
    "Is there a simpler way to do this?", "What should I read next to learn more?",
    "How can I tell whether it is working?", "Can you say that again in three sentences?",
    "What are the trade-offs of that approach?", "How would this work for a larger group?",
    "What could go wrong, and how do I recover?", "How does that compare with the alternative?",
    "Please sum up what we have covered so far.", "Thanks. What would you do differently yourself?",
]


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    max_tokens: int


def token_stream(encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """The 40 texts as one id stream (each followed by a blank line) and where each text starts in it."""
    stream: list[int] = []
    starts: list[int] = []
    for text in PROMPTS:
        starts.append(len(stream))
        stream.extend(encode(text + "\n\n"))
    return stream, starts


def shape_lengths(shape: str, seed: int) -> list[tuple[int, int]]:
    """(prompt length, new tokens) per request, deterministic for a seed.

    a: 32 requests x 64 new tokens, prompts evenly spread over 20-200 (3,520 prompt tokens) in seeded order;
    b: 128 requests, prompt and output lengths each drawn uniformly from 16-256;
    s: the single stream, 4 requests of 64 prompt tokens and 128 new tokens, sent one after another.
    """
    if shape == "s":
        return [(64, 128)] * 4
    if shape == "a":
        lengths = [20 + round(i * 180 / 31) for i in range(32)]
        random.Random(seed).shuffle(lengths)
        return [(p, 64) for p in lengths]
    if shape == "b":
        rng = random.Random(seed + 1)
        return [(rng.randint(16, 256), rng.randint(16, 256)) for _ in range(128)]
    raise ValueError(f"unknown shape {shape!r}; use a, b or s (shape c is a chat: bench.conversations.build_plan; "
                     "d and d4 copy their prompts: bench.shapes.shape_requests)")


def build_requests(shape: str, encode: Callable[[str], list[int]], seed: int = 0, quick: bool = False) -> list[Request]:
    """The requests of a shape; `quick` keeps the first 4, at 8 new tokens each."""
    stream, starts = token_stream(encode)
    lengths = shape_lengths(shape, seed)
    if quick:
        lengths = [(p, 8) for p, _ in lengths[:4]]
    out = []
    for i, (length, new_tokens) in enumerate(lengths):
        start = starts[i % len(starts)] + 5 * (i // len(starts))
        ids = [stream[(start + k) % len(stream)] for k in range(length)]
        out.append(Request(ids, new_tokens))
    return out


def describe(requests: Sequence[Request]) -> str:
    prompts = [len(r.prompt) for r in requests]
    outs = [r.max_tokens for r in requests]
    return (f"{len(requests)} requests, prompt tokens {sum(prompts):,} ({min(prompts)}-{max(prompts)}), "
            f"new tokens {sum(outs):,} ({min(outs)}-{max(outs)})")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def latency_summary(ttfts: Sequence[float], token_times: Sequence[Sequence[float]]) -> dict:
    """TTFT p50/p99 and pooled inter-token gap p50/p99, in milliseconds."""
    itl = [g for times in token_times for g in gaps(times)]
    ms = lambda v: None if v is None else v * 1e3
    return {
        "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
        "itl_count": len(itl),
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb() -> float | None:
    """Resident memory now (Linux); unlike the peak it leaves out what loading the model held briefly."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


# ------------------------------------------------------------------ the transformers peers (child side)
# Each takes the parsed `bench.batcher` arguments, the requests and the cb block count, and returns the raw
# run: start/end (perf_counter), per-request ids, errors, TTFTs and token times.

def load_hf(args):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # no EOS: every row runs its full length
    return model


def run_static(args, requests: list[Request], _blocks: int) -> dict:
    import torch
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    model = load_hf(args)
    loaded = peak_rss_mb()
    pad = 2 if model.config.pad_token_id is None else model.config.pad_token_id

    class StepTimer(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def batch(reqs: list[Request]) -> dict:
        width, steps = max(len(r.prompt) for r in reqs), max(r.max_tokens for r in reqs)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in reqs])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in reqs])
        config = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=pad)
        timer = StepTimer()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 logits_processor=LogitsProcessorList([timer]))
        end = time.perf_counter()
        gen = out[:, width:].tolist()
        if len(timer.times) != steps or any(len(g) != steps for g in gen):
            raise RuntimeError(f"static: ran {len(timer.times)} steps, rows of {sorted({len(g) for g in gen})}, "
                               f"expected {steps}")
        return {"start": start, "end": end, "ids": [g[:r.max_tokens] for g, r in zip(gen, reqs)], "errors": [],
                "ttfts": [timer.times[0] - start] * len(reqs), "times": [timer.times[:r.max_tokens] for r in reqs]}

    batch([Request(r.prompt[:16], 4) for r in requests[:2]])  # warm-up, untimed
    out = batch(requests)
    out["rss_after_load_mb"] = loaded
    return out


def run_cb(args, requests: list[Request], cb_blocks: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(args)
    loaded = peak_rss_mb()
    if args.cb_release_openmp:
        from ferrox_batch.runtime.kernels.openmp import release_thread_pool

        release_thread_pool()

    def session(reqs: list[Request]) -> dict:
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.max_tokens for r in reqs))
        cfg = ContinuousBatchingConfig(num_blocks=cb_blocks, page_size=args.cb_page_size,
                                       max_batch_tokens=args.cb_max_batch_tokens)
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cfg,
                                                       warmup=False) as manager:
            start = time.perf_counter()
            order = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens, record_timestamps=True)
                     for r in reqs]
            results: dict = {}
            end, deadline = start, time.monotonic() + args.timeout
            while len(results) < len(reqs):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                    end = time.perf_counter()
                elif result is None and (not manager.is_running() or time.monotonic() > deadline):
                    raise RuntimeError(f"cb: {len(results)}/{len(reqs)} finished, loop running: {manager.is_running()}")
        outs = [results[i] for i in order]
        return {"start": start, "end": end, "ids": [list(o.generated_tokens) for o in outs],
                "errors": [f"{o.request_id}: {o.error}" for o in outs if o.error],
                "ttfts": [o.timestamps[0] - o.created_time for o in outs if o.timestamps],
                "times": [o.timestamps or [] for o in outs]}

    session([Request(r.prompt[:16], 4) for r in requests[:2]])  # the untimed warm-up call
    out = session(requests)
    out["rss_after_load_mb"] = loaded
    return out
