"""The admission arithmetic: the upstream scheduler's own modules, mirrored one to one, torch-free.

Each module here is one module of the upstream's `serving/batch` (and `KvShape` from its models crate), under
the upstream's name: `config`, `counters`, `block_budget`, `budget` (`ContextCeiling`), `queue` (`QueueGate`
and `AbortInbox`, kept together as the upstream keeps them), `step_budget`, `cache_aware`, `clock`, `status`,
and `kv` (`KvShape`). `docs/upstream.md` maps each to its upstream module. Everything above (the scheduler,
the runtime, the engine) imports from here; nothing here imports from them.
"""

from ferrox_batch.admission.block_budget import BlockBudget
from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.admission.counters import Counters
from ferrox_batch.admission.queue import AbortInbox, QueueGate

__all__ = ["AbortInbox", "BatcherConfig", "BlockBudget", "ContextCeiling", "Counters", "QueueGate"]
