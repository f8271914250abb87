"""verl's FSDP2 engine under on-demand communication: engine strategy "odc".

verl 0.9.1 trains through ``TrainingWorker`` -> ``BaseEngine.train_batch`` (``optimizer_zero_grad``,
``forward_backward_batch``, ``optimizer_step``) of ``FSDPEngineWithLMHead`` (actor, SFT) or
``FSDPEngineWithValueHead`` (critic). The engines here subclass those two and change only what
equal microbatch counts forced:

* FSDP2 shards over ``"odc"`` process groups: verl's own FSDP mesh rebuilt over odc (a 1-D
  mesh, or for ``fsdp_size < world`` verl's 2-D ``("ddp", "fsdp")`` mesh, which ODC serves as
  HSDP: on demand inside each shard group, one all-reduce per mini-batch across replicas), and
  ``torch_odc.attach`` runs right after verl's ``apply_fsdp2``.
* ``forward_backward_batch`` lets each data-parallel rank cut its own rows into the microbatches
  their tokens need (verl's ``prepare_micro_batches`` with ``same_micro_num_in_dp=False``: no MAX
  over ranks); with ``odc_balance="mini"`` the mini-batch's sequences are first re-partitioned
  over the data-parallel ranks by LB-Mini and moved there (the step core, :mod:`torch_odc.step`).
  Under Ulysses sequence parallelism a data-parallel rank is one SP group: its ranks hold the
  same rows (verl's dispatch), plan the same microbatches (the token cap times the SP size, as
  verl scales it) and check that they did, once per mini-batch; SP groups run free.
* ``optimizer_step`` waits in the model's minibatch barrier before verl's clipping.
* Vision-language models of the Qwen2-VL family: a row's images travel with it, LB-Mini's
  cost counts their patches, and a microbatch without images runs no vision forward (verl's
  forward runs one on zeros; see ``_vision.py``). Multi-modal fields the engine has not worked
  out are refused by name, on every rank at once.
* ``train_batch`` reduces the per-microbatch ``Metric`` values over all ranks once, after the
  step (:func:`torch_odc.step.reduce_metrics`), to one value per rank, so that verl's ``Metric.aggregate_dp`` (which needs equal counts)
  logs what it logs for an equalized run.

Loss normalization is verl's own and already exact: its losses divide by the mini-batch's token
(or sequence) count over all ranks and multiply by the DP size, which FSDP2's (and ODC's)
gradient averaging divides back out.
"""

from __future__ import annotations

import copy
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

import torch_odc
from torch_odc import balance
from torch_odc import step as core

from . import _compat, _vision

# verl's names, through the compatibility manifest (_compat.py lists each with its release).
tu = _compat.load("verl.utils", "tensordict_utils")
AggregationType = _compat.load("verl.utils.metric", "AggregationType")
Metric = _compat.load("verl.utils.metric", "Metric")
FSDPEngineConfig = _compat.load("verl.workers.config", "FSDPEngineConfig")
EngineRegistry = _compat.load("verl.workers.engine.base", "EngineRegistry")
FSDPEngineWithLMHead = _compat.load(
    "verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead"
)
FSDPEngineWithValueHead = _compat.load(
    "verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithValueHead"
)
postprocess_batch_func = _compat.load("verl.workers.engine.utils", "postprocess_batch_func")
prepare_micro_batches = _compat.load("verl.workers.engine.utils", "prepare_micro_batches")

__all__ = [
    "STRATEGY",
    "ODCEngineConfig",
    "ODCEngineMixin",
    "ODCFSDPEngineWithLMHead",
    "ODCFSDPEngineWithValueHead",
]

STRATEGY = "odc"
_WHERE = f"torch_odc verl engine (strategy '{STRATEGY}')"
_BALANCE = ("local", "mini")
_COSTS = ("tokens", "flops", "verl")


@dataclass
class ODCEngineConfig(FSDPEngineConfig):
    """verl's ``FSDPEngineConfig`` plus the ODC options (all optional; a plain
    ``FSDPEngineConfig`` with ``strategy="odc"`` gets the defaults).

    Attributes:
        odc_balance: ``"local"``: each rank cuts its own rows into microbatches of at most
            ``max_token_len_per_gpu`` tokens (verl's own packing, without padding the count to
            the maximum over ranks). ``"mini"``: LB-Mini re-partitions each mini-batch's
            sequences over the data-parallel ranks by cost (ranks may hold different numbers of
            sequences, none included) and packs each rank's share; sequences move between ranks
            with one all-to-all per mini-batch. Needs ``use_dynamic_bsz``.
        odc_cost: LB-Mini's cost of a sequence: ``"tokens"``, ``"flops"`` (dense + attention
            FLOPs of this model, :func:`torch_odc.balance.flops_cost`) or ``"verl"`` (verl's
            own workload model, ``seqlen_balancing.calculate_workload``).
        odc_eager_publish: passed to :func:`torch_odc.attach`.
    """

    odc_balance: str = "local"
    odc_cost: str = "tokens"
    odc_eager_publish: bool = True

    def __post_init__(self):
        _compat.require("config", _WHERE)
        # FSDPEngineConfig accepts only its own strategy names; "odc" is FSDP2 underneath.
        strategy = self.strategy
        object.__setattr__(self, "strategy", "fsdp2")
        super().__post_init__()
        object.__setattr__(self, "strategy", strategy)
        if self.odc_balance not in _BALANCE:
            raise ValueError(f"odc_balance must be one of {_BALANCE}, got {self.odc_balance!r}")
        if self.odc_cost not in _COSTS:
            raise ValueError(f"odc_cost must be one of {_COSTS}, got {self.odc_cost!r}")


def _option(engine_config, name: str):
    return getattr(engine_config, name, ODCEngineConfig.__dataclass_fields__[name].default)


def _refusal(engine_config, model_config) -> str | None:
    """Why verl's configuration cannot run under ODC, or None."""
    if engine_config.offload_policy:
        return (
            "offload_policy=True (FSDP2 CPUOffloadPolicy) keeps the shards in host memory "
            "and copies them to the GPU at every all-gather; ODC serves peers' reads from "
            "shards in device memory, so it would hold a device copy of every shard for the "
            "whole minibatch: the memory the policy saves. Use param_offload=True (the "
            "shards leave the GPU between phases, ODC's memory too) or offload_policy=False"
        )
    if getattr(model_config, "enable_activation_offload", False):
        return "enable_activation_offload: not tried with ODC"
    return None


class ODCEngineMixin:
    """What the "odc" engines add to verl's FSDP engines (see the module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        # First: a verl release without what the engine uses is refused here, naming it.
        _compat.require("engine", _WHERE)
        # A forward-only engine (verl's reference model: ref.strategy follows actor.strategy)
        # trains nothing: it runs as verl's own FSDP2 engine (CPU-offloaded, equal counts).
        self.odc_active = not engine_config.forward_only
        problem = _refusal(engine_config, model_config) if self.odc_active else None
        if problem:
            raise NotImplementedError(f"{_WHERE}: {problem}.")
        self.odc_balance = _option(engine_config, "odc_balance")
        self.odc_cost = _option(engine_config, "odc_cost")
        self.odc_eager_publish = _option(engine_config, "odc_eager_publish")
        self.odc_handle = None
        # Vision-language models (``_vision.py``): the models whose text-only path this engine
        # runs without verl's dummy, and how many forwards ran with and without vision inputs.
        self.odc_vision_models: list = []
        self.odc_vision_forwards = {"text_only": 0, "with_vision": 0}
        # Per optimizer step of this rank: its microbatch count, sequences and tokens.
        self.odc_steps: list[dict] = []
        self.odc_forward_passes = 0
        # verl's FSDP engine branches on the strategy: this one is its FSDP2 path.
        fsdp2_config = copy.copy(engine_config)
        object.__setattr__(fsdp2_config, "strategy", "fsdp2")
        super().__init__(model_config, fsdp2_config, optimizer_config, checkpoint_config)

    # -- the process group and attach ---------------------------------------------------------

    def _init_device_mesh(self):
        super()._init_device_mesh()
        # verl's Ulysses mesh (dp x sp, over verl's default group) stays as it is: the SP
        # all-to-alls run inside every microbatch among an SP group's ranks, which run the same
        # microbatches. Only the FSDP mesh is rebuilt over odc.
        if not self.odc_active:
            return
        if isinstance(_compat.default_backend(torch.device("cpu")), torch_odc._C.OdcBackend):
            return  # verl's mesh already runs over odc
        self.device_mesh = _odc_mesh(self.device_mesh)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """verl's phase switches (``param_offload``: the train and eval contexts move the model
        to the CPU on exit and back on entry; ``optimizer_offload`` moves the optimizer state,
        which ODC does not hold). Before the model leaves, ODC gives back everything it holds
        (:func:`torch_odc.release_memory`: shard caches, accumulators, control words); when it
        is back, ODC takes it again. verl switches on every rank at the same point, as both
        calls need. On CPU ranks verl's device is the CPU and one call does both."""
        handle = self.odc_handle if self.odc_active and model else None
        if handle is not None and device == "cpu":
            handle.release_memory()
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if handle is not None and (device != "cpu" or handle.device.type == "cpu"):
            handle.restore_memory()

    def _build_module(self):
        module = super()._build_module()
        if self.odc_active:
            self.odc_vision_models = _vision.serve_without_dummy(module, self.odc_vision_forwards)
        return module

    def _build_fsdp_module(self, module):
        module = super()._build_fsdp_module(module)
        if self.odc_active:
            self.odc_handle = torch_odc.attach(module, eager_publish=self.odc_eager_publish)
            if not self.odc_handle.on_demand:
                # attach warned why (one rank, ranks on several hosts, no transport): FSDP2's
                # collectives run every microbatch, so verl's own path (equal counts) runs,
                # verl's own forward included (every rank runs the vision tower every time).
                self.odc_active = False
                _vision.undo(self.odc_vision_models)
                self.odc_vision_models = []
        return module

    # -- one mini-batch: this rank's microbatches, the barrier, the metrics ---------------------

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if not self.odc_active:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        # verl's packing scales the token cap by the SP size (an SP group's ranks share each
        # microbatch's tokens), as verl's own forward_backward_batch has it.
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        keep_outputs = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        # The loss denominators over the DP group, as verl's engine computes them: one
        # all-reduce per mini-batch, which every rank calls once (before LB-Mini moves rows:
        # the sum is the same). It also counts what the ranks' rows carry that the engine does
        # not serve, so that all of them refuse it together.
        refused = _vision.check(data, self.model_config.hf_config.model_type)
        num_tokens = data["loss_mask"].sum()
        totals = torch.stack(
            [
                num_tokens,
                torch.tensor(len(refused), dtype=num_tokens.dtype, device=num_tokens.device),
            ]
        )
        totals = totals.to(torch.device(self.device_mesh.device_type))
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.get_data_parallel_group())
        if totals[1].item():
            self._odc_refuse(refused, forward_only)
        tu.assign_non_tensor(
            data, batch_num_tokens=totals[0].item(), dp_size=self.get_data_parallel_size()
        )
        planned, started = None, time.perf_counter()
        if not forward_only and self.odc_balance == "mini":
            data, planned = self._odc_lb_mini(data, keep_outputs)
        balanced = time.perf_counter() - started
        images = _vision.row_images(data)
        if planned is not None:
            indices = planned
            micro_batches = [tu.index_select_tensor_dict(data, mb) for mb in planned]
        else:
            # verl's own packing of this rank's rows, without the MAX over ranks.
            micro_batches, indices = prepare_micro_batches(
                data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=False
            )
        if self.ulysses_sequence_parallel_size > 1:
            self._odc_check_sp_plan(data, indices, len(micro_batches), forward_only)
        outputs = []
        for index, micro_batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            sync = (
                nullcontext()
                if forward_only
                else _compat.call(self, "_gradient_sync_context", is_last_micro_batch=last)
            )
            grad = torch.no_grad() if forward_only else nullcontext()
            with grad, sync, torch.profiler.record_function(f"micro_batch{index}"):
                loss, meta = self.forward_step(
                    micro_batch, loss_function=loss_function, forward_only=forward_only
                )
                if not forward_only:
                    scaler = getattr(self, "scaler", None)
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    if not keep_outputs:
                        meta.pop("model_output", None)
            outputs.append(meta)
        if forward_only:
            self.odc_forward_passes += 1
        else:
            self.odc_steps.append(
                {
                    "microbatches": len(micro_batches),
                    "sequences": len(data),
                    "tokens": sum(_row_lengths(data)),
                    "received": self._odc_received if planned is not None else 0,
                    "moved": self._odc_moved if planned is not None else 0,
                    "balance_seconds": balanced,
                    **(
                        {}
                        if images is None
                        else {
                            "patches": sum(map(sum, images)),
                            # Microbatches that run the vision tower (with images).
                            "vision_microbatches": sum(
                                any(images[i] for i in mb) for mb in indices
                            ),
                            "cost": self._odc_cost if planned is not None else None,
                        }
                    ),
                }
            )
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def optimizer_step(self):
        # Every rank's gradients are complete only after the barrier: verl's clipping (a
        # collective over them), the GradScaler and the step come after it.
        if self.odc_active:
            self.odc_handle.barrier()
            # verl's dummy vision forward gives the vision tower a (zero) gradient in every
            # microbatch; where no rank had an image, ODC's barrier leaves none: zeros, so that
            # the optimizer steps as on verl's.
            zeroed = _vision.zero_missing_grads(self.odc_vision_models)
            if self.odc_vision_models and self.odc_steps:
                self.odc_steps[-1]["vision_grads_zeroed"] = zeroed
        return super().optimizer_step()

    def train_batch(self, data, loss_function):
        outputs = super().train_batch(data, loss_function)
        if self.odc_active and "metrics" in outputs:
            _reduce_metrics(outputs["metrics"], self.get_data_parallel_group())
        return outputs

    def _odc_refuse(self, mine: list[str], forward_only: bool) -> None:
        """Some rank's rows carry multi-modal fields the engine does not serve: every rank of
        the DP group raises, naming each problem and the ranks whose rows had it."""
        group = self.get_data_parallel_group()
        everyone = core.gather_objects(mine, group)
        peers = dist.get_process_group_ranks(group)
        seen: dict[str, list[int]] = {}
        for rank, problems in zip(peers, everyone):
            for problem in problems:
                seen.setdefault(problem, []).append(rank)
        what = (
            f"forward-only pass {self.odc_forward_passes + 1}"
            if forward_only
            else f"training step {len(self.odc_steps) + 1}"
        )
        detail = "; ".join(
            f"{problem} (rows of rank(s) {ranks})" for problem, ranks in seen.items()
        )
        raise NotImplementedError(
            f"{_WHERE}: rank {dist.get_rank()}, {what} of this engine: not served: {detail}"
        )

    def _odc_check_sp_plan(self, data, indices, count: int, forward_only: bool) -> None:
        """The ranks of one Ulysses SP group run each microbatch together (its all-to-alls are
        collectives of the group): they must have planned the same microbatches. One small
        all-gather over the SP group per mini-batch compares each rank's microbatch count and
        a checksum of its plan (rows per microbatch, row lengths); every rank of the group sees
        the same answer, so either all of them go on or all of them raise."""
        group = self.ulysses_parallel_group
        size = dist.get_world_size(group)
        plan = [list(map(int, mb)) for mb in indices] if indices is not None else None
        checksum = zlib.crc32(repr((plan, _row_lengths(data))).encode())
        mine = torch.tensor(
            [count, len(data), checksum],
            dtype=torch.int64,
            device=torch.device(self.device_mesh.device_type),
        )
        everyone = torch.empty(size * 3, dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(everyone, mine, group=group)
        seen = everyone.view(size, 3).tolist()
        if any(row != seen[0] for row in seen):
            peers = dist.get_process_group_ranks(group)
            what = (
                f"forward-only pass {self.odc_forward_passes + 1}"
                if forward_only
                else f"training step {len(self.odc_steps) + 1}"
            )
            detail = ", ".join(
                f"rank {r}: {c} microbatch(es) of {n} row(s), plan {h:08x}"
                for r, (c, n, h) in zip(peers, seen)
            )
            raise RuntimeError(
                f"{_WHERE}: rank {dist.get_rank()}, {what} of this engine: the ranks of its "
                f"Ulysses SP group {peers} planned different microbatches ({detail}). The "
                "ranks of one SP group must hold the same rows (verl's dispatch gives them "
                "the same data) and run the same microbatches"
            )

    # -- LB-Mini across the data-parallel ranks ------------------------------------------------

    def _odc_lb_mini(self, data, keep_outputs: bool):
        """Re-partitions the mini-batch's sequences over the DP ranks with LB-Mini and moves
        them there. Returns this rank's rows and its microbatches (lists of row positions)."""
        where = f"torch_odc verl engine, rank {dist.get_rank()}, odc_balance='mini'"
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            raise NotImplementedError(
                f"{where}: needs use_dynamic_bsz=True (LB-Mini packs microbatches up to "
                "max_token_len_per_gpu tokens)"
            )
        if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
            raise NotImplementedError(f"{where}: force_group_size > 1 is not supported")
        if keep_outputs:
            raise NotImplementedError(
                f"{where}: return_model_output=True would return other ranks' sequences"
            )
        group = self.get_data_parallel_group()
        world = dist.get_world_size(group)
        # The cap of a microbatch of one DP rank (an SP group shares its tokens), as verl's
        # prepare_micro_batches scales it.
        cap = int(data["max_token_len_per_gpu"]) * self.ulysses_sequence_parallel_size
        # Each row's tokens and, for a vision-language model, the patches of its images.
        step = core.gather_rows(_row_lengths(data), images=_vision.row_images(data), group=group)
        lengths, images = step.lengths, step.images
        cost = self._odc_cost_fn()
        # A row's cost: its tokens' under the cost model, plus each of its images' patches as a
        # sequence of that many (the vision tower attends within an image). The token cap is
        # verl's, on tokens (an image's placeholders are tokens too), and a longer row refused.
        costs = step.costs(cost, every_row=True)
        plan = core.plan_step(
            lengths,
            world,
            core.LBMini(cap, cost),
            costs=costs,
            oversized="raise",
            cap_note="max_token_len_per_gpu x ulysses_sequence_parallel_size; verl refuses it too",
            where=where,
        )
        # Rows move pickled (a TensorDict's rows may be nested tensors; a row's
        # multi_modal_inputs, its images, is one of its fields). LB-Mini's rank labels are
        # arbitrary: each rank takes the share it holds most rows of (verl's driver already
        # balanced the batch, so most rows stay where they are).
        exchanged = step.exchange(
            data.select(*_row_keys(data)),
            plan,
            keep_in_place=True,
            take=tu.index_select_tensor_dict,
            join=tu.concat_tensordict,
            where=where,
        )
        self._odc_received, self._odc_moved = exchanged.received, exchanged.moved
        rank = dist.get_rank(group)
        share = [i for mb in exchanged.plan[rank] for i in mb]
        self._odc_cost = sum(costs[i] for i in share)
        mine = exchanged.rows
        # As verl after its own pickling of rows: a VLM's (4, length) position ids come back
        # with the wrong ragged dimension.
        tu.maybe_fix_3d_position_ids(mine)
        if images is not None and (_vision.row_images(mine) or []) != [images[i] for i in share]:
            raise RuntimeError(
                f"{where}: the rows that arrived do not carry the images planned with them"
            )
        _copy_non_tensor(data, mine)
        return mine, exchanged.microbatches

    def _odc_cost_fn(self):
        if self.odc_cost == "tokens":
            return "tokens"
        if self.odc_cost == "verl":
            calculate_workload = _compat.load("verl.utils.seqlen_balancing", "calculate_workload")
            return lambda n: float(calculate_workload(torch.tensor(n, dtype=torch.int64)))
        config = self.model_config.hf_config
        # FSDP2's parameters are DTensors: numel() is the whole parameter's.
        num_params = sum(p.numel() for p in self.module.parameters())
        return lambda n: balance.flops_cost(
            n,
            num_params=num_params,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
        )


def _odc_mesh(mesh):
    """verl's FSDP mesh (the same ranks, shape and dimension names) over "odc" groups. verl's
    workers initialize the default group as "cpu:gloo,cuda:nccl"; verl's other collectives keep
    it. A 2-D ``("ddp", "fsdp")`` mesh (``fsdp_size < world``) is HSDP to FSDP2 and to ODC."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        group = dist.new_group(backend=torch_odc.BACKEND_NAME)
        return DeviceMesh.from_group(group, mesh.device_type, mesh_dim_names=names)
    odc = init_device_mesh(
        mesh.device_type,
        tuple(mesh.shape),
        mesh_dim_names=names,
        backend_override={name: torch_odc.BACKEND_NAME for name in names},
    )
    if not torch.equal(odc.mesh.cpu(), mesh.mesh.cpu()):
        raise RuntimeError(
            f"{_WHERE}: the odc mesh {odc.mesh.tolist()} does not place the "
            f"ranks as verl's FSDP mesh {mesh.mesh.tolist()}"
        )
    return odc


def _row_lengths(data) -> list[int]:
    """Tokens of each row (the attention span verl packs by)."""
    if len(data) == 0:
        return []
    input_ids = data["input_ids"]
    if input_ids.is_nested:
        return input_ids.offsets().diff().tolist()
    return data["attention_mask"].sum(dim=1).tolist()


def _row_keys(data) -> list[str]:
    return [
        k
        for k, v in data.items()
        if isinstance(v, torch.Tensor) or (getattr(v, "shape", None) and v.shape[0] == len(data))
    ]


def _copy_non_tensor(source, target) -> None:
    """The mini-batch's metadata (identical on every rank: sizes, flags, the token cap)."""
    rows = set(_row_keys(source))
    # TensorDict refuses `key in td`: compare key lists.
    present = set(target.keys())
    for key in list(source.keys()):
        if key not in rows and key not in present:
            tu.assign_non_tensor_data(target, key, tu.get_non_tensor_data(source, key, None))


def _reduce_metrics(metrics: dict, group) -> None:
    """Replaces each ``Metric`` (one value per microbatch of this rank) by one value per rank
    that verl's ``Metric.aggregate_dp`` turns into the aggregate over every microbatch of every
    rank: SUM -> the sum over all ranks divided by the DP size (what verl's mean over ranks of
    per-index sums gives with equal counts), MEAN -> the mean over all microbatches, MIN/MAX ->
    over all. Plain per-microbatch lists are left as they are (verl flattens them over ranks).
    One reduction (:func:`torch_odc.step.reduce_metrics`), after the optimizer step."""
    mine = {
        k: (v.aggregation.value, list(v.values))
        for k, v in metrics.items()
        if isinstance(v, Metric)
    }
    world = dist.get_world_size(group)
    for key, (kind, value, _) in core.reduce_metrics(mine, group, "torch_odc verl engine").items():
        kind = AggregationType(kind)
        if kind is AggregationType.SUM:
            value /= world
        metrics[key] = Metric(aggregation=kind, value=value)


@EngineRegistry.register(model_type="language_model", backend=STRATEGY, device=["cuda", "cpu"])
class ODCFSDPEngineWithLMHead(ODCEngineMixin, FSDPEngineWithLMHead):
    """verl's actor / SFT engine (``FSDPEngineWithLMHead``) under ODC."""


@EngineRegistry.register(model_type="value_model", backend=STRATEGY, device=["cuda", "cpu"])
class ODCFSDPEngineWithValueHead(ODCEngineMixin, FSDPEngineWithValueHead):
    """verl's critic engine (``FSDPEngineWithValueHead``) under ODC."""
