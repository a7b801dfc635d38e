"""What every `ferrox-batch` subcommand shares: the refusal type, value parsers for flags, the model
flags and how a model is found or fetched and loaded, and the defaults the CLI owns.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrox_batch.admission.config import (
    BatcherConfig,
)
from ferrox_batch.memory_size import parse_memory_size
from ferrox_batch.runtime.errors import FetchError, ModelLoadError

if TYPE_CHECKING:  # the CLI imports torch only once a command needs it: `--help` stays quick
    from ferrox_batch.runtime.loading.loader import LoadedModel


Handler = Callable[[argparse.Namespace, Mapping[str, str]], int]

#: What `--help` says the KV memory budget is when neither a block count nor a size is given: the
#: batcher then takes a share of the machine's memory (`runtime.kv.memory.default_kv_memory`).
DEFAULT_KV_MEMORY = "25 percent of available memory on the CPU, 80 percent of free GPU memory on CUDA"
#: Read by the CLI only: `BatcherConfig` counts blocks, and bytes per block depend on the loaded model.
ENV_KV_MEMORY = "FERROX_CB_KV_MEMORY"
#: The bearer token `serve` requires when `--api-key` is not given (vLLM reads VLLM_API_KEY the same way).
ENV_API_KEY = "FERROX_API_KEY"
ENV_HOME = "FERROX_HOME"
#: `--dtype` values: `runtime.device.PRECISION_NAMES` plus auto (spelled out so that `--help` needs no
#: torch; a test keeps the two equal).
DTYPE_CHOICES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "fp16w")
#: `--kv-cache-dtype`: auto and `runtime.device.KV_CACHE_DTYPES` (a test keeps them equal).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp32", "fp16", "bf16")
#: `--weights`: `runtime.quant.choice.WEIGHTS_CHOICES` (a test keeps them equal).
WEIGHTS_CHOICES = ("auto", "widen", "q8_0", "q4_0", "q4_1", "q5_0")
#: `--batch-invariant`: `runtime.invariance.BATCH_INVARIANT_CHOICES` (a test keeps them equal).
BATCH_INVARIANT_CHOICES = ("auto", "on", "off", "narrow")
#: `--pooling`: `generation_types.POOLING` (a test keeps them equal).
POOLING_CHOICES = ("last", "mean")
#: `--reasoning-parser`: `server.reasoning.REASONING_PARSERS` (a test keeps them equal).
REASONING_PARSER_CHOICES = ("deepseek_r1", "qwen3", "openai_gptoss")
#: `--tool-call-parser`: `server.harmony_choice.TOOL_CALL_PARSERS` (a test keeps them equal).
TOOL_CALL_PARSER_CHOICES = ("openai",)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: `create_app`'s defaults, repeated so that building the parser imports no server (nor torch); a test
#: keeps them equal to `server.requests` and `server.app`.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
#: `serve`'s `drain_timeout` (`server.listener.DEFAULT_DRAIN_TIMEOUT_SECS`), repeated for the same reason.
DEFAULT_DRAIN_TIMEOUT_SECS = 5.0
#: uvicorn's TRACE level, below DEBUG.
_TRACE = 5
#: Seconds `generate` waits for the batcher's worker to exit after its one request.
_CLOSE_SECS = 30.0


class CliError(Exception):
    """A refusal the user can act on: printed as one line, exit status `status`."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _subparser(subparsers: argparse._SubParsersAction, name: str, *, help: str, description: str,
               examples: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=textwrap.fill(description, 100),
                                   epilog=f"examples:\n{examples}",
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    parser.set_defaults(command=name)
    return parser


# ------------------------------------------------------------------ value parsers (argparse `type=`)

def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


_seed = non_negative_int


def _memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _device(text: str) -> str:
    if text == "auto":
        return text
    import torch  # only when a device is named: a malformed one fails here, as a flag error

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (try auto, cpu, cuda or cuda:1)") from None
    return text


# ------------------------------------------------------------------ shared flags and steps

def _add_home_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", metavar="DIR", default=None,
                        help=f"data folder (default: ${ENV_HOME} or ~/.cache/ferrox-batch)")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", metavar="PATH|NAME", default=None,
                       help="a Hugging Face-style folder (config.json, tokenizer.json, *.safetensors), a .gguf file, "
                            "or the name of a model `ferrox-batch fetch` knows (smollm2-135m-instruct, gemma3-270m), "
                            "fetched into <home>/models/ on first use (default: smollm2-135m-instruct)")
    group.add_argument("--device", type=_device, default="auto",
                       help="auto (CUDA if torch sees a GPU, else the CPU), cpu, cuda, cuda:N (default: auto)")
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="compute precision; fp16w is fp32 with the linear weights in fp16 (a CPU "
                            "without native bf16). auto is bf16 on CUDA; on the CPU bf16 where it has native bf16 "
                            "matmuls, else fp16w where fbgemm runs, else fp32 (default: auto)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                       help="what the KV cache stores; auto is fp16 under fp16w where the CPU decode kernel reads "
                            "the pool in place (half the bytes per position, widened exactly when read), else the "
                            "compute dtype: plain fp32 keeps fp32 K/V (default: auto)")
    group.add_argument("--weights", choices=WEIGHTS_CHOICES, default="auto",
                       help="how the weights are held: auto serves a .gguf in the quantized formats it stores (Q8_0, "
                            "Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) on the CPU and keeps a safetensors checkpoint dense; widen "
                            "widens every weight to --dtype; q8_0, q4_0, q4_1 or q5_0 quantize every linear weight and "
                            "the embedding at load (CPU) (default: auto)")
    group.add_argument("--batch-invariant", choices=BATCH_INVARIANT_CHOICES, default="auto",
                       help="whether each request's answer is the same alone or batched: on runs dense bf16 linears "
                            "on our batch-invariant kernel and refuses to load where some linear would not be "
                            "invariant (fp32 dense weights, CUDA); auto does the same where it costs nothing "
                            "measured and fails nothing; on AMX CPUs, where oneDNN's tile kernels are faster for "
                            "wide steps, auto is narrow: oneDNN runs dense bf16 layers, and a second copy of them in "
                            "our kernel runs the steps of up to 16 rows in one C call (narrow asks for that on any "
                            "CPU; refused on CUDA); off keeps oneDNN for dense bf16 (default: auto)")
    group.add_argument("--chat-template", metavar="FILE", default=None,
                       help="a Jinja chat template to use instead of the checkpoint's (for chat requests and "
                            "/tokenize)")
    _add_home_flag(group)
    group.add_argument("--no-progress", action="store_true", help="no progress bars while fetching")


def _home(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """`--home`, else `$FERROX_HOME`, else `~/.cache/ferrox-batch`."""
    from ferrox_batch.runtime.loading.fetch import ferrox_home_from_env

    return Path(args.home).expanduser() if args.home else ferrox_home_from_env(env)


def _say(message: str) -> None:
    """Progress notes go to stderr: `generate` keeps stdout for the text alone."""
    print(message, file=sys.stderr, flush=True)


def model_path(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """`--model` as a path; else the model it names (or the default one), fetched now if it is not there yet.

    A path that exists wins over a name, so a folder that happens to be called `gemma3-270m` is loaded as it is.
    """
    from ferrox_batch.runtime.loading.model_sources import DEFAULT_MODEL, MODELS

    if args.model and (args.model not in MODELS or Path(args.model).expanduser().exists()):
        return Path(args.model).expanduser()
    from ferrox_batch.runtime.loading.fetch import default_model_dir, fetch_default_model, is_complete

    source = MODELS[args.model] if args.model else DEFAULT_MODEL
    home = _home(args, env)
    if is_complete(default_model_dir(home, source)):
        return default_model_dir(home, source)
    which = "the default model" if source is DEFAULT_MODEL else source.display_name
    _say(f"{which} is not here yet: fetching it (once)")
    try:
        return fetch_default_model(home, progress=not args.no_progress, log=_say, source=source)
    except FetchError as err:
        raise CliError(f"could not fetch {which}: {err}") from None


def load(args: argparse.Namespace, env: Mapping[str, str]) -> LoadedModel:
    """The checkpoint `--model` names (or the default), on `--device` in `--dtype`; CliError if it cannot be."""
    from ferrox_batch.runtime.device import choose_device
    from ferrox_batch.runtime.loading.loader import load_model

    try:
        choose_device(args.device)  # a device torch cannot see is a bad setting: say so before fetching
    except ValueError as err:
        raise CliError(f"--device: {err}", status=2) from None
    path = model_path(args, env)
    try:
        return load_model(path, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          weights=args.weights, batch_invariant=args.batch_invariant,
                          chat_template=chat_template_text(args))
    except (ModelLoadError, ValueError, OSError) as err:  # UnsupportedArchitecture is a ModelLoadError
        message = str(err)
        raise CliError(message if str(path) in message else f"cannot load {path}: {message}") from None


def chat_template_text(args: argparse.Namespace) -> str | None:
    """The text of `--chat-template`'s file (None without the flag); CliError if it cannot be read."""
    if args.chat_template is None:
        return None
    try:
        return Path(args.chat_template).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"--chat-template: cannot read {args.chat_template}: {err}", status=2) from None


def env_config(env: Mapping[str, str]) -> BatcherConfig:
    """`BatcherConfig.from_env` over the serving defaults, with a malformed variable as a CliError (exit 2)."""
    try:
        return BatcherConfig.from_env(env, BatcherConfig.serving())
    except ValueError as err:
        raise CliError(str(err), status=2) from None
