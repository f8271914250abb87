"""verl 0.9.1 runs on 2 (and 4) CPU ranks, under the python of verl's own virtual environment.

    python tests/verl_cases.py OUT.json [two|one|four ...]   (tests/test_integrations_verl.py)

One launch of 2 ranks (tests/multiproc.run_ranks over a Gloo default group, as verl's workers
have it on CPU) runs every scenario, each on a fresh tiny Qwen2 model built from a config (same
seed, nothing downloaded): verl's own FSDP2 engine (strategy "fsdp2", equal microbatch counts)
as the reference, and the "odc" engines of torch_odc.integrations.verl on the same data. Each
rank writes what it saw (final parameters, logged metrics, microbatch counts, errors) and the
test compares. Worker, engines, losses and metric aggregation are verl's own
(TrainingWorker.train_mini_batch / train_batch, ppo_loss, value_loss). A launch of 1 rank runs
the fallback to verl's own path; one of 4 ranks verl's 2-D mesh (fsdp_size=2) and Ulysses
sequence parallelism (dp 2 x sp 2; on CPU through the shims of install_cpu_ulysses).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # verl's own FSDP engines: cuda/npu keys
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB = 96
MAX_TOKENS = 48  # max_token_len_per_gpu
PROMPT = 4  # prompt width (left-padded)
RESPONSE = 24  # response width (right-padded)


def _critic_classes():
    """verl 0.9.1 loads every critic with attn_implementation="flash_attention_2" hard-coded
    (utils/model.py load_valuehead_model), which CPU ranks cannot run. The critic test uses a
    Qwen2 token-classification model whose own attention check turns that request into eager
    attention; everything else is transformers' Qwen2ForTokenClassification."""
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForTokenClassification,
        Qwen2Config,
        Qwen2ForTokenClassification,
        Qwen2Model,
    )

    class CPUCriticConfig(Qwen2Config):
        model_type = "odc_cpu_critic"

    class CPUCriticModel(Qwen2ForTokenClassification):
        config_class = CPUCriticConfig

        def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
            if attn_implementation == "flash_attention_2":
                attn_implementation = "eager"
            return super()._check_and_adjust_attn_implementation(
                attn_implementation, *args, **kwargs
            )

    AutoConfig.register(CPUCriticConfig.model_type, CPUCriticConfig)
    AutoModel.register(
        CPUCriticConfig, type("CPUCriticBase", (Qwen2Model,), {"config_class": CPUCriticConfig})
    )
    AutoModelForTokenClassification.register(CPUCriticConfig, CPUCriticModel)
    return CPUCriticConfig


CPUCriticConfig = _critic_classes()


def build_model(path: str, critic: bool = False) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = (CPUCriticConfig if critic else Qwen2Config)(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if critic:
        config.num_labels = 1
        _critic_classes_model(config).save_pretrained(path)
    else:
        Qwen2ForCausalLM(config).save_pretrained(path)


def _critic_classes_model(config):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_config(config, attn_implementation="eager")


def make_batch(responses: list[int], seed: int, critic: bool = False):
    """A rollout batch as verl's PPO trainer hands it to the update (left-padded prompts of
    PROMPT tokens at most, right-padded responses), converted by verl's left_right_2_no_padding."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    n = len(responses)
    prompt_lens = torch.randint(2, PROMPT + 1, (n,), generator=g)
    prompts = torch.zeros(n, PROMPT, dtype=torch.long)
    responses_t = torch.zeros(n, RESPONSE, dtype=torch.long)
    attention = torch.zeros(n, PROMPT + RESPONSE, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens.tolist(), responses)):
        prompts[i, PROMPT - p :] = torch.randint(3, VOCAB, (p,), generator=g)
        responses_t[i, :r] = torch.randint(3, VOCAB, (r,), generator=g)
        attention[i, PROMPT - p : PROMPT + r] = 1
    response_mask = attention[:, PROMPT:].clone()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    fields = {
        "prompts": prompts,
        "responses": responses_t,
        "input_ids": torch.cat([prompts, responses_t], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
    }
    noise = torch.randn(n, RESPONSE, generator=g)
    if critic:
        fields["values"] = 0.1 * noise
        fields["returns"] = torch.randn(n, RESPONSE, generator=g)
    else:
        # Log-probs near the tiny model's (about -log(VOCAB)): ratios around 1, some clipped.
        base = -torch.log(torch.tensor(float(VOCAB)))
        fields["old_log_probs"] = base + 0.2 * noise
        fields["ref_log_prob"] = base + 0.2 * torch.randn(n, RESPONSE, generator=g)
        fields["advantages"] = torch.randn(n, RESPONSE, generator=g)
    td = TensorDict(fields, batch_size=[n])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0)
    return td


def rows(td, index: list[int]):
    from verl.utils import tensordict_utils as tu

    return tu.index_select_tensor_dict(td, index)


def make_worker(strategy: str, critic: bool, model_path: str, lr: float, **odc):
    """verl's TrainingWorker with strategy "fsdp2" (verl's own engine) or "odc"; ``odc`` holds
    the ODCEngineConfig options, ``engine`` more engine options (both strategies), ``model``
    more HFModelConfig options and ``optim`` FSDPOptimizerConfig options (SGD by default)."""
    import torch
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker

    from torch_odc.integrations.verl import ODCEngineConfig

    common = {
        "strategy": strategy,
        "model_dtype": "fp32",
        "use_torch_compile": False,
        "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": MAX_TOKENS,
        "infer_max_token_len_per_gpu": MAX_TOKENS,
        **odc.pop("engine", {}),
    }
    model = {
        "use_remove_padding": False,
        "override_config": {"attn_implementation": "eager"},
        **odc.pop("model", {}),
    }
    optim = {"optimizer": "SGD", "lr": lr, "weight_decay": 0.0, **odc.pop("optim", {})}
    engine = ODCEngineConfig(**common, **odc) if strategy == "odc" else FSDPEngineConfig(**common)
    config = TrainingWorkerConfig(
        model_type="value_model" if critic else "language_model",
        model_config=HFModelConfig(path=model_path, load_tokenizer=False, **model),
        engine_config=engine,
        optimizer_config=FSDPOptimizerConfig(clip_grad=10.0, total_training_steps=10, **optim),
        checkpoint_config=CheckpointConfig(),
    )
    torch.manual_seed(1)  # the critic's value head is initialized at random: the same in every run
    worker = TrainingWorker(config)
    worker.reset()
    return worker


def actor_loss(entropy_coeff: float = 0.01):
    from functools import partial

    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig
    from verl.workers.utils.losses import ppo_loss

    config = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        use_dynamic_bsz=True,
        entropy_coeff=entropy_coeff,
        calculate_entropy=True,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        clip_ratio=0.1,
        fsdp_config=FSDPEngineConfig(strategy="fsdp2"),
    )
    return partial(ppo_loss, config)


def critic_loss():
    from functools import partial

    from verl.workers.config import FSDPCriticConfig
    from verl.workers.utils.losses import value_loss

    config = FSDPCriticConfig(
        strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True, cliprange_value=0.5
    )
    return partial(value_loss, config)


def parameters(worker) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in worker.engine.module.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = full.detach().reshape(-1).tolist()
    return out


def metrics_of(output) -> dict:
    """The worker's returned metrics as plain numbers; lists of per-rank ``Metric`` objects (what
    TrainingWorker.train_batch returns) through verl's own ``Metric.aggregate_dp``, as
    train_mini_batch does."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import Metric

    if output is None:
        return None  # an SP rank other than its group's first: verl returns nothing there
    found = tu.get(output, "metrics")
    plain = {}
    for key, value in found.items():
        if key.startswith("perf/") or key == "mfu":
            continue  # memory and time
        if isinstance(value, list) and value and isinstance(value[0], Metric):
            value = Metric.aggregate_dp(value)
        elif isinstance(value, Metric):
            value = value.aggregate()
        elif isinstance(value, list) and value and isinstance(value[0], list):
            value = [x for part in value for x in part]  # per rank, per microbatch: flattened
        values = value if isinstance(value, list) else [value]
        plain[key] = [float(v) for v in values]
    return plain


def finish(worker) -> None:
    handle = getattr(worker.engine, "odc_handle", None)
    if handle is not None:
        handle.detach()


def mini_batch_run(
    rank,
    world,
    strategy,
    critic,
    model_path,
    dispatched,
    seed,
    odc,
    layout=None,
    after=None,
    make=None,
    before=None,
):
    """verl's update of one rollout batch: train_mini_batch over the rank's dispatched rows
    (verl's dispatch gives each rank an equal chunk), 2 mini-batches -> 2 optimizer steps.
    ``layout(rank, responses)`` gives the rank's rows of the whole batch where they are not
    ``responses[rank]`` (the ranks of one SP group hold the same rows); ``after(worker)``
    runs before the worker is finished, its result under "after"; ``make(rows, seed)`` builds
    the batch from the rows' specs (default: make_batch of response lengths);
    ``before(worker)`` runs once the worker is built, its result (a dict it may keep
    updating) under "before"."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    if critic:
        model_path = model_path + "-critic"
    worker = make_worker(strategy, critic, model_path, lr=0.5, **odc)
    worker.set_loss_fn(critic_loss() if critic else actor_loss())
    seen = before(worker) if before is not None else None
    logged, forward = [], []
    for call, responses in enumerate(dispatched):
        specs = [r for part in responses for r in part]
        whole = (
            make(specs, seed + call) if make is not None else make_batch(specs, seed + call, critic)
        )
        per_rank = len(responses[0])
        start = sum(len(p) for p in responses[:rank])
        mine = (
            list(range(start, start + len(responses[rank])))
            if layout is None
            else layout(rank, responses)
        )
        # As verl's trainer before the update: old log-probs (values) from a forward-only pass
        # of the same engine; under ODC with each rank's own microbatch count, and then the
        # update starts with zero_grad() after that forward.
        probe = rows(whole, mine)
        tu.assign_non_tensor(probe, compute_loss=False, calculate_entropy=True)
        inferred = worker.infer_batch(probe)
        if inferred is None:  # an SP rank other than its group's first
            forward.append(None)
        else:
            inferred = tu.get(inferred, "values" if critic else "log_probs")
            # What verl's trainer keeps of it (no_padding_2_padding: the response positions;
            # the last position of a sequence predicts whatever follows it in its microbatch).
            padded = no_padding_2_padding(inferred, rows(whole, mine))
            forward.append(padded[rows(whole, mine)["response_mask"].bool()].tolist())
        data = rows(whole, mine)
        tu.assign_non_tensor(
            data,
            global_batch_size=world * per_rank // 2,
            mini_batch_size=world * per_rank // 2,
            epochs=1,
            seed=7,
            dataloader_kwargs={"shuffle": False},
            calculate_entropy=True,
        )
        logged.append(metrics_of(worker.train_mini_batch(data)))
    steps = list(getattr(worker.engine, "odc_steps", []))
    result = {
        "metrics": logged,
        "params": parameters(worker),
        "steps": steps,
        "forward": forward,
        "mesh": meshes(worker.engine),
    }
    if seen is not None:
        result["before"] = seen
    if after is not None:
        result["after"] = after(worker)
    finish(worker)
    return result


def meshes(engine) -> dict:
    """The engine's FSDP mesh (names, shape, each dimension's backend) and verl's Ulysses
    mesh (shape, this rank's SP group)."""
    import torch
    import torch.distributed as dist

    mesh = engine.device_mesh
    backends = [
        type(mesh.get_group(d)._get_backend(torch.device("cpu"))).__name__ for d in range(mesh.ndim)
    ]
    out = {
        "names": list(mesh.mesh_dim_names),
        "shape": list(mesh.shape),
        "backends": backends,
        "groups": [dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)],
    }
    if engine.ulysses_device_mesh is not None:
        out["sp_mesh"] = list(engine.ulysses_device_mesh.shape)
        out["sp_group"] = dist.get_process_group_ranks(engine.ulysses_parallel_group)
    return out


def train_batch_run(rank, world, strategy, model_path, responses, split, seed, odc):
    """TrainingWorker.train_batch (one optimizer step per call) with rows ``split[rank]`` of
    the batch on each rank: the shape an LB-Mini dispatch gives (ranks with different numbers
    of sequences)."""
    from verl.utils import tensordict_utils as tu

    worker = make_worker(strategy, False, model_path, lr=0.5, **odc)
    worker.set_loss_fn(actor_loss())
    logged = []
    for step in range(2):
        whole = make_batch(responses, seed + step)
        data = rows(whole, split[rank])
        tu.assign_non_tensor(
            data,
            global_batch_size=len(whole),
            calculate_entropy=True,
            global_token_num=[int(x) for x in data["input_ids"].offsets().diff()],
        )
        logged.append(metrics_of(worker.train_batch(data)))
    steps = list(getattr(worker.engine, "odc_steps", []))
    result = {"metrics": logged, "params": parameters(worker), "steps": steps}
    finish(worker)
    return result


def fallback_run(rank, world, model_path, dispatched, seed) -> dict:
    """An "odc" actor where attach cannot serve the model on demand: what it warned, and the
    run (mini_batch_run)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = mini_batch_run(rank, world, "odc", False, model_path, dispatched, seed, {})
    result["warned"] = [str(w.message) for w in caught if "torch_odc.attach" in str(w.message)]
    return result


def one_rank(rank, world, model_path) -> dict:
    """verl on one rank (torchrun --nproc-per-node 1): verl's FSDP2 engine and the "odc" one,
    which keeps FSDP2's own path (a group of one rank has nothing to communicate)."""
    torch_threads_and_env(rank, world)
    dispatched = [[[r for part in UNEVEN for r in part]]]  # every row on the one rank
    return {
        "ref": mini_batch_run(rank, world, "fsdp2", False, model_path, dispatched, 50, {}),
        "odc": fallback_run(rank, world, model_path, dispatched, 50),
    }


def reference_engine(model_path: str) -> dict:
    """A forward-only engine (verl's reference model; ref.strategy follows actor.strategy) with
    strategy "odc": built, not refused, and inactive (it runs as verl's FSDP2 engine). verl
    builds it with CPUOffloadPolicy(pin_memory=True), which needs CUDA: not initialized here."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from torch_odc.integrations.verl import ODCEngineConfig

    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(
            path=model_path, load_tokenizer=False, override_config={"attn_implementation": "eager"}
        ),
        engine_config=ODCEngineConfig(
            strategy="odc",
            forward_only=True,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=MAX_TOKENS,
            infer_max_token_len_per_gpu=MAX_TOKENS,
        ),
        optimizer_config=None,
        checkpoint_config=CheckpointConfig(),
    )
    engine = TrainingWorker(config).engine
    return {"class": type(engine).__name__, "active": engine.odc_active}


def refused(model_path: str, **engine) -> str:
    try:
        worker = make_worker("odc", False, model_path, lr=0.1, engine=engine)
    except NotImplementedError as e:
        return str(e)
    finish(worker)
    return "not refused"


# Response lengths per rank (verl's dispatch: equal counts). Rank 0 holds the long ones: verl
# packs them into 2 microbatches per mini-batch and pads rank 1 (1 needed) to 2 as well.
UNEVEN = [[22, 20, 24, 21, 23, 19, 20, 22], [3, 2, 4, 3, 2, 3, 4, 2]]
EVEN = [[10, 12, 11, 9, 10, 12, 11, 9], [11, 9, 10, 12, 9, 11, 10, 12]]
# One long response and many short ones per mini-batch: LB-Mini gives one rank the long one
# (and a short one), the other the rest: different numbers of sequences per rank.
SKEWED = [[23, 2, 3, 2, 24, 3, 2, 2], [2, 3, 2, 2, 3, 2, 2, 3]]
# Six sequences; under ODC rank 1 holds the short one alone (rows 0-1, 3-5 on rank 0).
SINGLE = [20, 22, 3, 21, 19, 23]


def torch_threads_and_env(rank: int, world: int) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    )  # verl's Worker reads these; the group already exists


def ranks(rank: int, world: int, model_path: str) -> dict:
    torch_threads_and_env(rank, world)
    out, timings = {}, {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out[name] = fn(*args, **kwargs)
        timings[name] = time.perf_counter() - t0

    actor_data = [UNEVEN, EVEN]
    timed("actor_ref", mini_batch_run, rank, world, "fsdp2", False, model_path, actor_data, 10, {})
    timed("actor_odc", mini_batch_run, rank, world, "odc", False, model_path, actor_data, 10, {})
    mini_data = [SKEWED, UNEVEN]
    timed("mini_ref", mini_batch_run, rank, world, "fsdp2", False, model_path, mini_data, 40, {})
    timed(
        "mini_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        model_path,
        mini_data,
        40,
        {"odc_balance": "mini", "odc_cost": "verl"},
    )
    # verl's param_offload / optimizer_offload: the engine's phase switches (train and eval
    # contexts) release ODC's memory and take it back, every rank at the same point.
    offload = {"engine": {"param_offload": True, "optimizer_offload": True}}
    timed(
        "offload_ref",
        mini_batch_run,
        rank,
        world,
        "fsdp2",
        False,
        model_path,
        actor_data,
        10,
        copy.deepcopy(offload),
    )
    timed(
        "offload_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        model_path,
        actor_data,
        10,
        copy.deepcopy(offload),
        after=lambda worker: worker.engine.odc_handle.stats()["releases"],
    )
    critic_data = [UNEVEN]
    timed("critic_ref", mini_batch_run, rank, world, "fsdp2", True, model_path, critic_data, 20, {})
    timed("critic_odc", mini_batch_run, rank, world, "odc", True, model_path, critic_data, 20, {})
    # Six sequences: verl's equalized run gets 3 and 3, ODC's rank 1 a single short one.
    timed(
        "single_ref",
        train_batch_run,
        rank,
        world,
        "fsdp2",
        model_path,
        SINGLE,
        [[0, 1, 2], [3, 4, 5]],
        30,
        {},
    )
    timed(
        "single_odc",
        train_batch_run,
        rank,
        world,
        "odc",
        model_path,
        SINGLE,
        [[0, 1, 3, 4, 5], [2]],
        30,
        {},
    )
    # Ranks on two hosts (ODC_HOST_ID): attach keeps FSDP2's collectives, and the engine runs
    # verl's own path (equal counts) instead of ODC's.
    os.environ["ODC_HOST_ID"] = f"host{rank}"
    try:
        timed("hosts_odc", fallback_run, rank, world, model_path, actor_data, 10)
    finally:
        del os.environ["ODC_HOST_ID"]
    vlm_scenarios(timed, rank, world, model_path)
    out["reference"] = reference_engine(model_path)
    out["refused_offload"] = refused(model_path, offload_policy=True)
    out["timings"] = timings
    return out


# -- vision-language rows: a tiny Qwen2-VL (tests/verl_vlm.py) -------------------------------

VLM_TOKENS = 64  # max_token_len_per_gpu of the VLM cases (verl_vlm.calls()'s rows)
VLM_ENGINE = {"max_token_len_per_gpu": VLM_TOKENS, "infer_max_token_len_per_gpu": VLM_TOKENS}
# AdamW (verl's default) with weight decay: a step whose vision parameters got only zeros (no
# image on any rank) still moves them on verl's engine (by ~lr: the moments of earlier steps),
# and must under ODC too. eps 1e-4 rather than 1e-8: AdamW divides by sqrt(v) + eps, which
# turns the last bits of a gradient element that nearly cancels (the order in which ranks'
# gradients are summed differs, 1e-9 of 1e-7) into a step of up to lr x 1e-2, near the 1e-6
# bound; with 1e-4 such an element moves by lr x 1e-5 at most.
VLM_OPTIM = {
    "optimizer": "AdamW",
    "lr": 2e-3,
    "weight_decay": 0.01,
    "override_optimizer_config": {"eps": 1e-4},
}


def _vlm_before(worker) -> dict:
    import verl_vlm

    seen = verl_vlm.count_vision_forwards(worker)
    seen["dummy_start"] = verl_vlm.DUMMY_CALLS["dummy"]
    return seen


def _vlm_after(worker, refuse: bool = False) -> dict:
    import verl_vlm

    out = {
        "dummy_end": verl_vlm.DUMMY_CALLS["dummy"],
        "odc": dict(getattr(worker.engine, "odc_vision_forwards", {})),
    }
    if refuse:
        out["refused"] = _vlm_refused(worker)
    return out


def _vlm_refused(worker) -> str:
    """A train_batch whose rows on rank 1 carry 'mm_token_type_ids' (a field verl pads per
    microbatch): every rank must refuse it, naming the field and rank 1 (none may hang)."""
    import torch
    import torch.distributed as dist
    import verl_vlm
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    whole = verl_vlm.make_batch([verl_vlm.row(4, 6, images=[(4, 4)]), verl_vlm.row(4, 6)] * 2, 99)
    data = rows(whole, [0, 1] if dist.get_rank() == 0 else [2, 3])
    if dist.get_rank() == 1:
        inputs = [dict(getattr(x, "data", x)) for x in data.get("multi_modal_inputs")]
        inputs[0]["mm_token_type_ids"] = torch.zeros(1, 12, dtype=torch.long)
        data["multi_modal_inputs"] = NonTensorStack.from_list([NonTensorData(d) for d in inputs])
    tu.assign_non_tensor(
        data,
        global_batch_size=4,
        calculate_entropy=True,
        global_token_num=[int(x) for x in data["input_ids"].offsets().diff()],
    )
    try:
        worker.train_batch(data)
    except NotImplementedError as e:
        return str(e)
    return "not refused"


def vlm_scenarios(timed, rank: int, world: int, model_path: str) -> None:
    """verl's own engine (its dummy vision forward working: verl_vlm.install_dummy_fix) and
    the "odc" engine, local packing and LB-Mini, on the same rows with images, a video and
    none; AdamW."""
    import verl_vlm

    verl_vlm.install_dummy_fix()
    path, data = model_path + "-vlm", verl_vlm.calls()
    common = {"make": verl_vlm.make_batch, "before": _vlm_before}
    odc = {"engine": VLM_ENGINE, "optim": VLM_OPTIM}
    timed(
        "vlm_ref",
        mini_batch_run,
        rank,
        world,
        "fsdp2",
        False,
        path,
        data,
        80,
        copy.deepcopy(odc),
        after=_vlm_after,
        **common,
    )
    timed(
        "vlm_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        path,
        data,
        80,
        copy.deepcopy(odc),
        after=lambda w: _vlm_after(w, refuse=True),
        **common,
    )
    timed(
        "vlm_mini_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        path,
        data,
        80,
        {**copy.deepcopy(odc), "odc_balance": "mini", "odc_cost": "tokens"},
        after=_vlm_after,
        **common,
    )
    # Qwen2.5-VL (a vision tower with a windowed block), local packing.
    path = model_path + "-vlm25"
    timed(
        "vlm25_ref",
        mini_batch_run,
        rank,
        world,
        "fsdp2",
        False,
        path,
        data,
        90,
        copy.deepcopy(odc),
        after=_vlm_after,
        **common,
    )
    timed(
        "vlm25_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        path,
        data,
        90,
        copy.deepcopy(odc),
        after=_vlm_after,
        **common,
    )


def vlm_ranks(rank: int, world: int, model_path: str) -> dict:
    """The VLM scenarios alone (launch "vlm", for working on them; CI runs them in "two")."""
    torch_threads_and_env(rank, world)
    out, timings = {}, {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out[name] = fn(*args, **kwargs)
        timings[name] = time.perf_counter() - t0

    vlm_scenarios(timed, rank, world, model_path)
    out["timings"] = timings
    return out


# -- 4 ranks: verl's 2-D ("ddp", "fsdp") mesh (fsdp_size=2) and Ulysses SP (dp 2 x sp 2) ------

SP_ATTENTION = "odc_test_varlen_sdpa"  # reaches verl's Ulysses wrapper (see install_cpu_ulysses)
SHIM_CALLS = {"attention": 0, "all_to_all": 0}  # calls of the shims in this process


def install_cpu_ulysses() -> None:
    """What verl's Ulysses path needs on CPU ranks, for these tests only (verl unchanged):

    * an attention name, registered through transformers' ``AttentionInterface``, whose function
      is transformers' own flash-attention forward: it calls its module's
      ``_flash_attention_forward``, which verl replaces by its Ulysses wrapper (all-to-alls
      around the kernel) when ``use_remove_padding`` or SP is on;
    * the kernel verl's wrapper calls (flash-attention's varlen kernel, absent here) backed by
      SDPA run per packed sequence: the sequences of a microbatch lie in one row, each
      restarting its ``position_ids`` at 0;
    * verl's ``all_to_all_tensor`` (a list ``all_to_all``, which Gloo lacks on torch 2.11) over
      ``all_to_all_single``, the same exchange."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import verl.models.transformers.monkey_patch as verl_patch
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from verl.utils import ulysses

    AttentionInterface.register(SP_ATTENTION, flash_attention_forward)

    def varlen_sdpa(
        query,
        key,
        value,
        attention_mask,
        query_length,
        is_causal=True,
        dropout=0.0,
        position_ids=None,
        softmax_scale=None,
        sliding_window=None,
        softcap=None,
        **_,
    ):
        # (batch 1, tokens, heads, head_dim), as flash-attention takes them.
        assert (
            attention_mask is None and not dropout and sliding_window is None and softcap is None
        ), "varlen_sdpa: an option this test shim does not serve"
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if k.size(1) != q.size(1):  # grouped-query attention, as flash-attention maps it
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        length = q.size(2)
        starts = (
            [0]
            if position_ids is None
            else (position_ids.reshape(-1) == 0).nonzero().flatten().tolist()
        )
        if not starts or starts[0] != 0:
            starts = [0] + starts
        bounds = starts + [length]
        SHIM_CALLS["attention"] += 1
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[:, :, a:b],
                    k[:, :, a:b],
                    v[:, :, a:b],
                    is_causal=is_causal,
                    scale=softmax_scale,
                )
                for a, b in itertools.pairwise(bounds)
            ],
            dim=2,
        )
        return out.transpose(1, 2)

    def all_to_all_tensor(local_input, scatter_dim, gather_dim, group=None, async_op=False):
        group = ulysses.get_ulysses_sequence_parallel_group() if group is None else group
        n = dist.get_world_size(group)
        parts = [t.contiguous() for t in torch.tensor_split(local_input, n, scatter_dim)]
        send = torch.cat([t.reshape(-1) for t in parts])
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        SHIM_CALLS["all_to_all"] += 1
        out = torch.cat(
            [c.view(parts[0].shape) for c in received.chunk(n)], dim=gather_dim
        ).contiguous()
        return (lambda: out) if async_op else out

    verl_patch._flash_attention_forward = varlen_sdpa
    ulysses.all_to_all_tensor = all_to_all_tensor


# Per rank (4 rows each, 2 mini-batches of 2 rows per call). Call 0: ranks 0 and 1 hold long
# rows (2 microbatches per mini-batch of 48 tokens), ranks 2 and 3 short ones (1); call 1: ranks
# 0 and 2 need 2 microbatches in their first mini-batch, ranks 1 and 3 one.
FOUR = [
    [[24, 23, 22, 24], [23, 24, 24, 22], [3, 2, 4, 3], [2, 3, 3, 2]],
    [[24, 23, 3, 2], [2, 3, 4, 2], [22, 24, 3, 3], [3, 2, 2, 4]],
]
SP = 2
FOUR_MODEL = {"use_remove_padding": True, "override_config": {"attn_implementation": SP_ATTENTION}}


def sp_layout(rank: int, responses) -> list[int]:
    """The rows of the SP group of ``rank`` (dp rank = rank // SP; both ranks of a group hold the
    same rows): the rows of ranks 2d and 2d+1 of the 4-rank layout, ordered so that each
    mini-batch of the SP group (4 rows) is the union of those two ranks' mini-batches (2 rows
    each): the same mini-batches as verl's sp=1 run, whose parameters these runs must reach."""
    first = [sum(len(p) for p in responses[:r]) for r in range(len(responses))]
    d = rank // SP
    own = [list(range(first[r], first[r] + len(responses[r]))) for r in range(SP * d, SP * d + SP)]
    half = len(own[0]) // 2
    return [i for part in own for i in part[:half]] + [i for part in own for i in part[half:]]


def sp_mismatch(worker) -> str:
    """A train_batch in which the two ranks of each SP group hold different rows: every rank
    of the group must refuse it, naming itself and the step (none may hang)."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu

    whole = make_batch([20, 3, 22, 4], 99)
    data = rows(whole, [0, 1] if dist.get_rank() % SP == 0 else [2, 3])
    tu.assign_non_tensor(
        data,
        global_batch_size=4,
        calculate_entropy=True,
        global_token_num=[int(x) for x in data["input_ids"].offsets().diff()],
    )
    try:
        worker.train_batch(data)
    except RuntimeError as e:
        return str(e)
    return "not refused"


def four_ranks(rank: int, world: int, model_path: str) -> dict:
    torch_threads_and_env(rank, world)
    install_cpu_ulysses()
    out, timings = {}, {}

    def timed(name, fn, *args, **kwargs):
        t0, before = time.perf_counter(), dict(SHIM_CALLS)
        out[name] = fn(*args, **kwargs)
        out[name]["shim_calls"] = {k: SHIM_CALLS[k] - before[k] for k in SHIM_CALLS}
        timings[name] = time.perf_counter() - t0

    hsdp = {"engine": {"fsdp_size": 2}, "model": FOUR_MODEL}
    sp = {"engine": {"ulysses_sequence_parallel_size": SP}, "model": FOUR_MODEL}
    # verl's own HSDP run is also verl's sp=1 run on the same mini-batches (the SP runs below).
    timed("hsdp_ref", mini_batch_run, rank, world, "fsdp2", False, model_path, FOUR, 60, dict(hsdp))
    timed("hsdp_odc", mini_batch_run, rank, world, "odc", False, model_path, FOUR, 60, dict(hsdp))
    timed(
        "sp_ref",
        mini_batch_run,
        rank,
        world,
        "fsdp2",
        False,
        model_path,
        FOUR,
        60,
        dict(sp),
        layout=sp_layout,
    )
    timed(
        "sp_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        model_path,
        FOUR,
        60,
        dict(sp),
        layout=sp_layout,
        after=sp_mismatch,
    )
    # LB-Mini over the DP ranks (each SP group's ranks move the same rows); and SP inside
    # verl's 2-D mesh (fsdp_size=2: the shard groups are the SP groups, replicas across them).
    timed(
        "sp_mini_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        model_path,
        FOUR,
        60,
        {**sp, "odc_balance": "mini"},
        layout=sp_layout,
    )
    timed(
        "sp_hsdp_odc",
        mini_batch_run,
        rank,
        world,
        "odc",
        False,
        model_path,
        FOUR,
        60,
        {"engine": {"fsdp_size": 2, "ulysses_sequence_parallel_size": SP}, "model": FOUR_MODEL},
        layout=sp_layout,
    )
    out["timings"] = timings
    return out


def main() -> None:
    """``verl_cases.py OUT.json [LAUNCH ...]``: every launch (``two``, ``one``, ``four``) unless
    some are named (a launch left out is left out of OUT.json); ``vlm`` runs the VLM
    scenarios of ``two`` alone."""
    from multiproc import run_ranks

    target, chosen = sys.argv[1], set(sys.argv[2:]) or {"two", "one", "four"}
    import verl_vlm

    found, walls = {}, {}
    launches = (
        ("two", "ranks", 2, ranks, 600.0),
        ("one", "one_rank", 1, one_rank, 300.0),
        ("four", "four_ranks", 4, four_ranks, 900.0),
        ("vlm", "vlm_ranks", 2, vlm_ranks, 600.0),
    )
    with tempfile.TemporaryDirectory(prefix="odc-verl-") as tmp:
        model_path = os.path.join(tmp, "model")
        build_model(model_path)
        build_model(model_path + "-critic", critic=True)
        verl_vlm.build_model(model_path + "-vlm")
        verl_vlm.build_model(model_path + "-vlm25", family="qwen2_5_vl")
        t0 = time.perf_counter()
        for launch, key, world, fn, timeout in launches:
            if launch in chosen:
                started = time.perf_counter()
                got = run_ranks(
                    world, fn, model_path, backend="gloo", timeout=timeout, pg_timeout=120.0
                )
                found[key] = got[0] if world == 1 else got
                walls[launch] = time.perf_counter() - started
        wall = time.perf_counter() - t0
    import torch
    import transformers
    import verl

    import torch_odc

    versions = {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_odc": torch_odc.__file__,
    }
    with open(target, "w") as f:
        json.dump({**found, "wall_s": wall, "launch_wall_s": walls, "versions": versions}, f)


if __name__ == "__main__":
    main()
