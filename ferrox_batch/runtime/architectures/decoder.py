"""The Llama-family decoder: one varlen forward over a paged KV store.

`Decoder.forward(chunks, store)` is the only call the scheduler makes: a batch
that mixes prefill chunks of several sequences with single-token decodes of
others, returning the last-position logits of each sequence (float32, in the
order given). Every projection runs once over the flat batch; attention runs
once for the decode group and, in each layer, once for all the prefill chunks
on the CPU or once per chunk elsewhere (`runtime.architectures.attention`, over the inputs
`batch_inputs` builds).

On the CPU four hot spots run in small C kernels (`cpu_kernels`): the decode
group's attention reads K/V straight from the pool, the prefill chunks'
attention widens each chunk's K/V once and scores query tiles against it in
registers (`prefill_plan` describes the chunks to it), each RMSNorm takes the
residual add before it in the same call, and RoPE rotates q and k in place in
the fused projection and writes K/V to the pool in the same pass. Set
`kernels = None` to use torch's ops instead (CUDA always does); both paths
agree to float rounding. Where every projection is one fp16 panel kernel
(`fp16w` on an AVX2 CPU), the whole layer loop runs in one C call instead
(`layer_stack`): the same kernels in the same order, bit for bit, without
the Python between them.

Weights are held fused (`q|k|v` and `gate|up`) so each layer is four
matmuls, prepacked at load on the CPU (`runtime.architectures.linear`): for oneDNN, or in
fp16 when the precision is `fp16w` (for the fp16-weight C kernel, or fbgemm);
there the C kernel also applies the MLP's SiLU gate inside the gate/up
projection (`runtime.architectures.gate_up`). The decoder is stateless
between calls; all per-sequence state is in the store.

The store may hold K/V narrower than the decoder computes (`kv_dtype`: fp16
under `fp16w`, chosen by `runtime.device.choose_kv_dtype`): they are rounded
once, when written, and widened wherever read (exactly, in the C kernel; by a
copy of the gathered context on the torch path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrox_batch.runtime.architectures.checkpoint_taker import CheckpointTaker
from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.layer import Layer
from ferrox_batch.runtime.architectures.layer_builder import build_layer
from ferrox_batch.runtime.architectures.layer_stack import LayerStack
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.linear_factory import LinearFactory
from ferrox_batch.runtime.architectures.norms import add_norm
from ferrox_batch.runtime.architectures.per_layer_input import PerLayerEmbedding
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear, is_quantized_kind
from ferrox_batch.runtime.architectures.rope import RopeTables
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.device import KV_CACHE_DTYPES
from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.kernels.cpu_kernels import CpuKernels, cpu_kernels
from ferrox_batch.runtime.kernels.packed_quant import PackedQuant
from ferrox_batch.runtime.kv.batch_inputs import SeqChunk, build_group_inputs
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan
from ferrox_batch.runtime.quant.formats import QuantFormat
from ferrox_batch.runtime.quant.weight import Weight


class Decoder:
    """Build from a Hugging Face-named state dict; the dict is consumed (entries are popped as
    they are converted, so a load never holds two full copies of the weights)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        weights_format: str = "dtype",
        kv_dtype: torch.dtype | None = None,
        keep_quantized: bool = False,
        quantize_to: QuantFormat | None = None,
        int8_activations: bool = True,
        batch_invariant: bool = False,
        narrow_panels: bool = False,
    ) -> None:
        """`weights_format` is how the linear layers (the lm head included) store their dense weights:
        in `dtype`, or "fp16" (an fp32 model on the CPU; `runtime.architectures.linear`). `kv_dtype` is what the KV
        store holds (`dtype` when None): K and V are rounded to it once, when written. `keep_quantized` serves
        the checkpoint's quantized weights (`QuantizedWeight`s in `weights`) as stored, in every format the
        kernels run here, widening the rest; `quantize_to` quantizes every dense 2-D weight (the linears and
        the embedding) to that format at load. Either needs the CPU kernels (ModelLoadError otherwise).
        `int8_activations` picks the quantized layers' kernel: int8 activations and integer dot products over
        weights repacked at load (the default: llama.cpp's arithmetic, and each row's result independent of
        its batch), or the weight-only kernel that decodes the file's blocks to float32 and leaves x as it
        is (exactly the widened weights' product, summed in another order). `batch_invariant` runs dense bf16
        linears on our bf16 kernel rather than oneDNN's (`Linear`), so that with the other kernels here each
        row's logits depend on that row alone (`batch_invariant` after load says whether every linear does).
        `narrow_panels` has the layers' dense bf16 weights that oneDNN runs also held in our kernel's panels, and
        the layer stack run over those for narrow steps (`runtime.architectures.layer_stack`)."""
        if kv_dtype is None:
            kv_dtype = dtype
        if kv_dtype not in KV_CACHE_DTYPES.values():
            raise ValueError(f"a KV store holds one of {', '.join(KV_CACHE_DTYPES)}; got {kv_dtype}")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.weights_format = weights_format
        self.kernels = self.kernels_for(self.device, dtype)
        self.int8_activations = int8_activations
        #: Every linear layer's (and the embedding's) kernel and weight format: the one place they are chosen.
        self.linear_factory = LinearFactory.build(
            device=self.device, dtype=dtype, kernels=self.kernels, weights_format=weights_format,
            keep_quantized=keep_quantized, quantize_to=quantize_to, int8_activations=int8_activations,
            batch_invariant=batch_invariant, narrow_panels=narrow_panels)
        take = CheckpointTaker(weights, self.linear_factory.prepare)
        self.embed = self.linear_factory.embedding(take("model.embed_tokens.weight",
                                                        (config.vocab_size, config.hidden_size)))
        #: Whether the output head multiplies by the embedding's own weight (a packed head still owns its packing).
        self.lm_head_tied = config.tie_word_embeddings and "lm_head.weight" not in weights
        # The head is one call from Python whatever the step: it keeps one copy of its weight.
        if self.lm_head_tied:
            self.lm_head = self._linear(self.embed.weight, keep_weight=True, narrow=False)
        else:
            self.lm_head = self._linear(take("lm_head.weight", (config.vocab_size, config.hidden_size)), narrow=False)
        #: Every layer's own input, made once per forward, where the model has them (`per_layer_input`).
        self.per_layer = PerLayerEmbedding.build(config, take, self.linear_factory)
        family = config.family_spec
        self.final_norm = take("model.norm.weight", (config.hidden_size,)) + family.norm_offset
        self.layers: list[Layer] = [build_layer(spec, i, take, self.linear_factory, family.norm_offset)
                                    for i, spec in enumerate(family.layers(config))]
        unused = set(weights) - {"lm_head.weight"}
        unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
        if unused:
            raise ModelLoadError(f"checkpoint has tensors this architecture does not use: {sorted(unused)[:5]}")
        # One pair of tables per RoPE kind the layers use. A layer without RoPE writes its K/V through the same
        # kernel with tables that rotate by nothing: cos 1 and sin 0 leave every value exactly as it was.
        kinds = {kind for kind in (getattr(layer.mixer, "rope", None) for layer in self.layers) if kind is not None}
        self.rope_tables = RopeTables(config, kinds | {"global"}, self.device, dtype)
        self.rope = self.rope_tables.tables
        self.cos, self.sin = self.rope["global"]
        # The embeddings' scale as the reference applies it: rounded to the compute dtype first.
        self.embed_scale = None if config.embed_scale == 1.0 else torch.tensor(config.embed_scale, dtype=dtype)
        # The layers in one C call where every projection runs one of our kernels (`runtime.architectures.layer_stack`).
        #: Why the layers run in the Python loop rather than the C stack (None where the stack runs them).
        self.layer_stack_declined: str | None = "no C kernels here" if self.kernels is None else \
            LayerStack.declines(self.layers, config, dtype)
        self.layer_stack = None if self.layer_stack_declined else LayerStack.bind(self.layers, config, dtype)
        if self.layer_stack is None and self.layer_stack_declined is None:
            self.layer_stack_declined = ("not every projection runs one of the stack's kernels (fp16 panels, bf16 "
                                         "panels or packed int8 quantized weights, without biases)")
        if self.layer_stack is None or not self.layer_stack.narrow_only:
            # Copies no stack runs (a model the stack does not take: biases, per-head norms, GELU, quantized
            # layers beside dense ones) would only double the layers' memory.
            for linear in self._linears():
                if isinstance(linear, (Linear, GateUp)):
                    linear.drop_narrow()

    @staticmethod
    def kernels_for(device: torch.device, dtype: torch.dtype) -> CpuKernels | None:
        """The C kernels a decoder on `device` computing in `dtype` runs (None: torch's ops only)."""
        if device.type == "cpu" and CpuKernels.supports(dtype):
            return cpu_kernels()
        return None

    def _linear(self, weight: Weight | PackedQuant, bias: torch.Tensor | None = None, *,
                keep_weight: bool = False, narrow: bool = True) -> Linear | QuantizedLinear:
        return self.linear_factory.linear(weight, bias, keep_weight=keep_weight, narrow=narrow)

    def _linears(self) -> list[Linear | QuantizedLinear | GateUp]:
        own = [] if self.per_layer is None else [self.per_layer.projection]
        return [self.lm_head, *own, *(linear for layer in self.layers for linear in layer.linears())]

    @property
    def weight_formats(self) -> dict[str, int]:
        """How many linear layers (the lm head included) keep their weight in each quantized format, and how
        many are dense ("dense")."""
        formats: dict[str, int] = {}
        for linear in self._linears():
            name = linear.kind if is_quantized_kind(linear.kind) else "dense"
            formats[name] = formats.get(name, 0) + 1
        return formats

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take in memory: the embedding, every linear layer as it stores its
        weight (quantized blocks, packed or dense; a head tied to the embedding counted once), the norms."""
        total = self.embed.nbytes + (0 if self.per_layer is None else self.per_layer.nbytes)
        for linear in self._linears():
            if linear is self.lm_head and self.lm_head_tied and (linear.kind == "plain" or is_quantized_kind(linear.kind)):
                continue  # it multiplies by the embedding's own memory
            total += linear.nbytes
        norms = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.norms())
        return total + self.final_norm.numel() * self.final_norm.element_size() + norms

    @property
    def linear_kinds(self) -> dict[str, int]:
        """How many linear layers run each kernel (`Linear.kind`; a quantized layer's formats): what the load
        actually got."""
        kinds: dict[str, int] = {}
        for linear in self._linears():
            kinds[linear.kind] = kinds.get(linear.kind, 0) + 1
        return kinds

    @property
    def batch_invariant(self) -> bool:
        """Whether every linear layer (the lm head included) runs a kernel whose output rows each depend on that
        input row alone: ours for fp16 or bf16 weights, or the int8 quantized kernel. The decoder's other
        kernels are row-wise already (norms, RoPE, attention over each sequence's own keys), so each request's
        logits are then the same alone or batched."""
        return (self.linear_factory.batch_invariant_over(linear.kind for linear in self._linears())
                and all(block.batch_invariant for layer in self.layers for block in layer.blocks()))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_store(
        self, block_size: int, *, num_blocks: int | None = None, memory_bytes: int | None = None,
        prefix_cache: bool = False,
    ) -> PagedKvStore:
        """A paged KV store for this model, sized by a block count or a memory budget (exactly one)."""
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_bytes")
        if num_blocks is not None:
            return PagedKvStore(self.config, num_blocks, block_size, device=self.device, dtype=self.kv_dtype,
                                prefix_cache=prefix_cache)
        return PagedKvStore.from_memory_budget(
            self.config, int(memory_bytes), block_size, device=self.device, dtype=self.kv_dtype,
            prefix_cache=prefix_cache,
        )

    def forward(self, chunks: Sequence[SeqChunk], store: PagedKvStore) -> torch.Tensor:
        """Append each chunk to its sequence's KV and return `[len(chunks), vocab]` float32 logits."""
        return self.forward_every(chunks, store, ())[0]

    def forward_every(self, chunks: Sequence[SeqChunk], store: PagedKvStore,
                      every: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`, and for each chunk index in `every` (ascending) the `[len(chunk), vocab]` logits of
        every one of its positions (what a prompt's own log-probabilities are read from)."""
        logits, spans, _ = self.forward_pooled(chunks, store, every, ())
        return logits, spans

    @torch.inference_mode()
    def forward_pooled(self, chunks: Sequence[SeqChunk], store: PagedKvStore, every: Sequence[int],
                       pooling: Sequence[tuple[int, str]]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """`forward_every`, and for each (chunk index, mode) in `pooling` its positions' final hidden states
        (after the final norm, float32) pooled: `"mean"` their sum (the caller divides by the prompt's
        length, over its chunks), `"last"` the last one's: what an embedding is made of."""
        c = self.config
        if store.dtype != self.kv_dtype or store.device != self.device:
            raise ValueError(
                f"store holds {store.dtype} on {store.device} but the decoder's KV is {self.kv_dtype} on {self.device}"
            )
        kernel = self.kernels
        # One set of inputs per KV group (its own block tables; a local group's through the window), the
        # tokens, positions and last rows shared: a model of one kind of layer has one group.
        groups = build_group_inputs(chunks, store, c.vocab_size, decode_gather=kernel is None)
        inputs = groups[0]
        n_tok = inputs.tokens.numel()
        # From the host-side lengths, not `positions.max()`: no device sync on CUDA.
        top = max(length for _, length in inputs.new_lengths) - 1
        if top >= c.max_position_embeddings:
            raise ValueError(
                f"position {top} is past this model's {c.max_position_embeddings} trained positions"
            )
        if self.rope_tables.cover(top):
            self.rope = self.rope_tables.tables
            self.cos, self.sin = self.rope["global"]
        plans: list[PrefillPlan | None] = [None] * len(groups)
        if kernel is not None:  # once per forward and group; the kernels read and write unchecked
            for group, seen in enumerate(groups):
                slots = store.pools[group].shape[1]
                kernel.check_rope_store(seen.positions, seen.slots, self.cos.shape[0], slots)
                if seen.decode is not None:
                    d = seen.decode
                    kernel.check_decode_ranges(d.tables, d.lo, d.hi, store.block_size, slots // store.block_size)
                if seen.prefill:
                    plans[group] = PrefillPlan.of(seen.prefill)
                    plans[group].check(slots)
        ctx = ForwardContext(kernel, store, groups, plans, self.rope, None, n_tok, c.rms_norm_eps)
        if kernel is None:
            ctx.rope_rows = {kind: (cos[inputs.positions][:, None, :], sin[inputs.positions][:, None, :])
                             for kind, (cos, sin) in self.rope.items()}

        h = self.embed(inputs.tokens)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.per_layer is not None:
            ctx.layer_inputs = self.per_layer(inputs.tokens, h, c.rms_norm_eps)
        pending: torch.Tensor | None = None  # the feed-forward output still to be added to h
        if kernel is not None and self.layer_stack is not None and self.layer_stack.takes(n_tok):
            # the loop below in one C call (bit for bit where the stack runs the layers' own weights)
            # Bound only where every layer is of one kind: one group, its slots the layers.
            pending = self.layer_stack.run(kernel, h, inputs, plans[0], store.kv, store.block_size, self.cos,
                                           self.sin)
        eps = c.rms_norm_eps
        for layer in self.layers if pending is None else ():
            h, x = add_norm(h, pending, layer.input_norm, eps, kernel)
            out = layer.mixer.forward(x, ctx)
            if layer.residual_scale is not None:
                out = out * layer.residual_scale
            h, x = add_norm(h, out, layer.post_norm, eps, kernel)
            pending = layer.ffn.forward(x, ctx)
            if layer.residual_scale is not None:
                pending = pending * layer.residual_scale
            if layer.after is not None or layer.output_scale is not None:
                h = h + pending
                pending = None
                if layer.after is not None:
                    h = h + layer.after.forward(h, ctx)
                if layer.output_scale is not None:
                    h = h * layer.output_scale

        rows = inputs.last_rows
        if every:  # the last rows, then every row of the chunks asked for, through one norm and lm_head
            ends = rows.tolist()
            spans = [torch.arange(ends[i] - len(chunks[i].tokens) + 1, ends[i] + 1, device=rows.device)
                     for i in every]
            rows = torch.cat([rows, *spans])
        pooled = []
        ends = inputs.last_rows.tolist() if pooling else []
        for index, mode in pooling:
            span = (torch.arange(ends[index] - len(chunks[index].tokens) + 1, ends[index] + 1, device=h.device)
                    if mode == "mean" else inputs.last_rows[index:index + 1])
            _, hidden = add_norm(h[span], None if pending is None else pending[span], self.final_norm, eps, kernel)
            pooled.append(hidden.float().sum(dim=0))
        _, h = add_norm(h[rows], None if pending is None else pending[rows], self.final_norm, eps, kernel)
        logits = self.lm_head(h)
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.logit_softcap is not None:
            logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
        logits = logits.float()
        for seq_id, length in inputs.new_lengths:
            store.seq(seq_id).length = length
        if not every:
            return logits, [], pooled
        sizes = [len(chunks[i].tokens) for i in every]
        return logits[: len(chunks)], list(logits[len(chunks):].split(sizes)), pooled
