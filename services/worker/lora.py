"""Several LoRA adapters and the base model in one batch.

Every adapter the worker knows is held in host memory (services/worker/lora_weights.py); at most
`max_loras` of them are *resident*, each in a slot of stacked per-linear tensors
(A [slots, in, bands * max_rank], B [slots, bands * max_rank, out]). A step that needs an adapter
without a slot copies it into the least recently used slot no row of the step needs.

Per step the tokens are grouped by adapter (`LoraBatch`): one row of a padded index matrix per
adapter present, base-model tokens in none. Each adapted linear then adds, on top of its base
product, two batched matrix products over the groups (`torch.bmm` of the gathered tokens by
their slot's A, then by its B) and one `index_add_` back onto the tokens' rows: the same few
tensor ops however many requests or adapters share the step, no loop over rows. A padding entry
names token 0 and has its low-rank product zeroed (one multiply by the step's mask), so the sum
back needs no selection of the real entries. A step whose tokens all use one adapter skips the
grouping: two dense products onto the base output. Everything a linear reads of the grouping is
built once per step, not per linear (benchmarks/lora_step.py times the two against the base model).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vmesh.services.worker.lora_weights import FUSED_TARGETS, LoraAdapter, LoraLoadError, load_peft_adapter
from vmesh.services.worker.persistent_batch import PersistentBatch, PlanError, StepInputs

if TYPE_CHECKING:
    from vmesh.services.common.model_spec import ModelSpec
    from vmesh.services.common.step_types import StepPlan
    from vmesh.services.worker.config import WorkerConfig
    from vmesh.services.worker.mlp import AnyLinear
    from vmesh.services.worker.model import DecoderModel

logger = logging.getLogger(__name__)

BASE_ADAPTER_ID = 0  # the base model: rows with it get no low-rank product


class LoraStepError(PlanError):
    """A step that names an adapter the worker does not hold, or more adapters than it has slots."""


@dataclass
class LoraBatch:
    """One step's tokens grouped by adapter: `slots[g]` is group g's slot, `token_index[g]` its
    tokens' rows in the step (padded with row 0), `valid[g]` which entries are real."""

    slots: torch.Tensor  # [groups]
    token_index: torch.Tensor  # [groups, longest group]
    valid: torch.Tensor  # [groups, longest group] bool
    flat_index: torch.Tensor  # token_index[valid]
    # The slots as a range when they are consecutive (the usual case): each linear then reads its
    # stacks as a view rather than gathering a copy of them, twice per layer.
    slot_range: slice | None = None
    # Every token of the step under this one slot: the linears skip gathering and scattering.
    whole_step_slot: int | None = None

    @property
    def padded_index(self) -> torch.Tensor:
        """token_index flattened, padding included (it names token 0)."""
        return self.token_index.flatten()

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoraBatch | None:
        """token_slots: [tokens] each token's slot, -1 for the base model. None when no token is adapted."""
        adapted = torch.nonzero(token_slots >= 0).squeeze(1)
        if not len(adapted):
            return None
        slots_of_adapted = token_slots[adapted]
        order = torch.argsort(slots_of_adapted, stable=True)
        grouped_tokens, grouped_slots = adapted[order], slots_of_adapted[order]
        slots, counts = torch.unique_consecutive(grouped_slots, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        group = torch.repeat_interleave(torch.arange(len(slots)), counts)
        column = torch.arange(len(grouped_tokens)) - starts[group]
        width = int(counts.max())
        token_index = torch.zeros(len(slots), width, dtype=torch.int64)
        valid = torch.zeros(len(slots), width, dtype=torch.bool)
        token_index[group, column] = grouped_tokens
        valid[group, column] = True
        first = int(slots[0])
        consecutive = bool(torch.equal(slots, torch.arange(first, first + len(slots))))
        return cls(slots=slots, token_index=token_index, valid=valid, flat_index=token_index[valid],
                   slot_range=slice(first, first + len(slots)) if consecutive else None,
                   whole_step_slot=first if len(slots) == 1 and len(adapted) == len(token_slots) else None)

    def to(self, device: torch.device) -> LoraBatch:
        return LoraBatch(slots=self.slots.to(device), token_index=self.token_index.to(device),
                         valid=self.valid.to(device), flat_index=self.flat_index.to(device), slot_range=self.slot_range,
                         whole_step_slot=self.whole_step_slot)

    def stacked(self, stack: torch.Tensor) -> torch.Tensor:
        """stack[slots]: a view where the slots are consecutive."""
        return stack[self.slot_range] if self.slot_range is not None else stack[self.slots]


class StepAdapters:
    """The batch the adapted linears read during one forward pass (set by the model's forward),
    and what they derive from it, once per step."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None
        self.padded_index: torch.Tensor | None = None
        self._padding_masks: dict[torch.dtype, torch.Tensor] = {}

    def set(self, batch: LoraBatch | None) -> None:
        self.batch = batch
        self.padded_index = batch.padded_index if batch is not None else None
        self._padding_masks = {}

    def padding_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[groups, longest group, 1]: 1 for a real entry, 0 for padding."""
        assert self.batch is not None, "read during a step with adapted tokens"
        mask = self._padding_masks.get(dtype)
        if mask is None:
            mask = self._padding_masks[dtype] = self.batch.valid.unsqueeze(-1).to(dtype)
        return mask


class LoraLinear:
    """A base linear plus its slots' low-rank products for the step's adapted tokens. Everything
    else (weights held, kernel description, bias) is the base layer's."""

    def __init__(self, base: AnyLinear, max_loras: int, band_width: int, step: StepAdapters, dtype: torch.dtype,
                 device: torch.device):
        self.base = base
        self.step = step
        self.lora_a = torch.zeros(max_loras, base.in_features, band_width, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, band_width, base.out_features, dtype=dtype, device=device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def write_slot(self, slot: int, fused: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if fused is None:  # the adapter leaves this linear alone
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            return
        a, b = fused
        self.lora_a[slot].copy_(a)
        self.lora_b[slot].copy_(b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.step.batch
        if batch is None:
            return out
        flat = x.reshape(-1, x.shape[-1]).to(self.lora_a.dtype)
        out_rows = out.view(-1, out.shape[-1])
        if batch.whole_step_slot is not None:
            slot = batch.whole_step_slot
            if out.dtype == self.lora_b.dtype:
                out_rows.addmm_(flat @ self.lora_a[slot], self.lora_b[slot])
            else:
                out_rows.add_((flat @ self.lora_a[slot] @ self.lora_b[slot]).to(out.dtype))
            return out
        groups, width = batch.token_index.shape
        index = self.step.padded_index
        assert index is not None, "set with the batch"
        shrunk = torch.bmm(flat.index_select(0, index).view(groups, width, -1), batch.stacked(self.lora_a))
        shrunk *= self.step.padding_mask(shrunk.dtype)  # padding adds nothing to token 0
        expanded = torch.bmm(shrunk, batch.stacked(self.lora_b))
        out_rows.index_add_(0, index, expanded.view(groups * width, -1).to(out.dtype))
        return out


class LoraManager:
    """The adapters one worker rank holds, their slots, and each step's grouping."""

    def __init__(self, model: DecoderModel, full_spec: ModelSpec, max_loras: int, max_rank: int):
        if any(layer.plan.mlp.is_moe for layer in model.layers):
            raise LoraLoadError("LoRA adapters are not supported on mixture-of-experts models")
        self.full_spec = full_spec
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = model.dtype
        self.tp_rank = model.parallel.rank if model.parallel is not None else 0
        self.tp_size = model.parallel.size if model.parallel is not None else 1
        self.step = StepAdapters()
        self.linears: dict[tuple[int, str], LoraLinear] = {}
        # The first step decides whether the layers run as one C call (services/worker/decoder_stack.py),
        # which reads the plain projections and would bypass these wrappers.
        assert model.decoder_stack_enabled is None, "LoRA wraps the layers before the model's first step"
        for index, layer in enumerate(model.layers):
            for name, modules in FUSED_TARGETS.items():
                owner = layer if name in ("qkv_proj", "o_proj") else layer.mlp
                wrapped = LoraLinear(getattr(owner, name), max_loras, len(modules) * max_rank, self.step,
                                     model.dtype, model.device)
                setattr(owner, name, wrapped)
                self.linears[(index, name)] = wrapped
        self.adapters: dict[int, LoraAdapter] = {}
        self.id_of_name: dict[str, int] = {}
        self._next_id = BASE_ADAPTER_ID + 1
        self.slot_of_id: OrderedDict[int, int] = OrderedDict()  # resident adapters, least recently used first
        self.free_slots = list(range(max_loras))

    @classmethod
    def for_config(cls, model: DecoderModel, full_spec: ModelSpec, config: WorkerConfig) -> LoraManager:
        """The worker's manager with --lora-modules loaded."""
        manager = cls(model, full_spec, config.max_loras, config.max_lora_rank)
        for name, path in config.lora_module_paths().items():
            manager.load(name, path)
            logger.info("LoRA adapter %s loaded from %s", name, path)
        return manager

    # --- the registry ---------------------------------------------------------------------

    def load(self, name: str, path: str) -> int:
        """Read the adapter into host memory under `name` (replacing none: a name is loaded once)."""
        if name in self.id_of_name:
            raise LoraLoadError(f"an adapter named {name!r} is already loaded")
        adapter = load_peft_adapter(name, path, self.full_spec, self.max_rank, self.dtype, self.tp_rank, self.tp_size)
        for key, (a, b) in adapter.fused.items():
            linear = self.linears[key]
            if tuple(a.shape) != tuple(linear.lora_a.shape[1:]) or tuple(b.shape) != tuple(linear.lora_b.shape[1:]):
                raise LoraLoadError(f"adapter {name!r}: layer {key[0]} {key[1]} does not fit the model "
                                    f"(A {tuple(a.shape)}, B {tuple(b.shape)})")
        adapter_id = self._next_id
        self._next_id += 1
        self.adapters[adapter_id] = adapter
        self.id_of_name[name] = adapter_id
        return adapter_id

    def unload(self, name: str, batch: PersistentBatch | None = None) -> None:
        """Forget adapter `name`, unless a row of `batch` still runs with it."""
        adapter_id = self.id_of_name.get(name)
        if adapter_id is None:
            raise LoraLoadError(f"no adapter named {name!r} is loaded")
        if batch is not None and (in_use := int((batch.adapter_ids[:len(batch)] == adapter_id).sum())):
            raise LoraLoadError(f"adapter {name!r} is in use by {in_use} running requests")
        del self.id_of_name[name]
        del self.adapters[adapter_id]
        slot = self.slot_of_id.pop(adapter_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def adapter_id(self, name: str) -> int:
        """The id rows carry for adapter `name` ("" is the base model)."""
        if not name:
            return BASE_ADAPTER_ID
        adapter_id = self.id_of_name.get(name)
        if adapter_id is None:
            raise LoraStepError(f"no adapter named {name!r} is loaded on this worker")
        return adapter_id

    def names(self) -> list[str]:
        return list(self.id_of_name)

    def paths(self) -> list[str]:
        """Each adapter's directory, in `names`' order."""
        return [self.adapters[adapter_id].path for adapter_id in self.id_of_name.values()]

    # --- per step ---------------------------------------------------------------------------

    def assign_rows(self, plan: StepPlan, batch: PersistentBatch) -> None:
        """Give the plan's new rows (already added to `batch`) their adapters' ids."""
        for request in plan.new_requests:
            batch.adapter_ids[batch.row_of_handle[request.handle]] = self.adapter_id(request.lora_name)

    def begin_step(self, batch: PersistentBatch, inputs: StepInputs, device: torch.device) -> None:
        """Group the step's tokens by their rows' adapters and make every adapter they use
        resident; the model's adapted linears read the grouping until `end_step`."""
        tokens_per_row = inputs.num_scheduled + inputs.num_drafts
        token_adapters = torch.repeat_interleave(batch.adapter_ids[inputs.rows], tokens_per_row)
        ids = torch.unique(token_adapters).tolist()
        needed = [i for i in ids if i != BASE_ADAPTER_ID]
        if not needed:
            self.step.set(None)
            return
        if len(needed) > self.max_loras:
            raise LoraStepError(f"a step uses {len(needed)} adapters; this worker has --max-loras {self.max_loras}")
        for adapter_id in needed:
            self._make_resident(adapter_id, needed)
        slot_table = torch.full((max(ids) + 1,), -1, dtype=torch.int64)
        slot_table[torch.tensor(needed)] = torch.tensor([self.slot_of_id[i] for i in needed])
        grouped = LoraBatch.from_token_slots(slot_table[token_adapters])
        self.step.set(grouped.to(device) if grouped is not None else None)

    def _make_resident(self, adapter_id: int, needed: list[int]) -> None:
        if adapter_id not in self.adapters:
            raise LoraStepError(f"adapter id {adapter_id} is not loaded on this worker")
        if adapter_id in self.slot_of_id:
            self.slot_of_id.move_to_end(adapter_id)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # the least recently used adapter this step does not need gives up its slot
            victim = next(i for i in self.slot_of_id if i not in needed)
            slot = self.slot_of_id.pop(victim)
        adapter = self.adapters[adapter_id]
        for key, linear in self.linears.items():
            linear.write_slot(slot, adapter.fused.get(key))
        self.slot_of_id[adapter_id] = slot

    def end_step(self) -> None:
        self.step.set(None)
