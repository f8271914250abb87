"""verl 0.9.1 runs on 2 CPU ranks, under the python of verl's own virtual environment.

    python tests/verl_cases.py OUT.json        (tests/test_integrations_verl.py runs it)

One launch of 2 ranks (tests/multiproc.run_ranks over a Gloo default group, as verl's workers
have it on CPU) runs every scenario, each on a fresh tiny Qwen2 model built from a config (same
seed, nothing downloaded): verl's own FSDP2 engine (strategy "fsdp2", equal microbatch counts)
as the reference, and the "odc" engines of torch_odc.integrations.verl on the same data. Each
rank writes what it saw (final parameters, logged metrics, microbatch counts, errors) and the
test compares. Worker, engines, losses and metric aggregation are verl's own
(TrainingWorker.train_mini_batch / train_batch, ppo_loss, value_loss).
"""

from __future__ import annotations

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
PROMPT = 4       # prompt width (left-padded)
RESPONSE = 24    # response width (right-padded)


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
            return super()._check_and_adjust_attn_implementation(attn_implementation, *args,
                                                                 **kwargs)

    AutoConfig.register(CPUCriticConfig.model_type, CPUCriticConfig)
    AutoModel.register(CPUCriticConfig, type("CPUCriticBase", (Qwen2Model,),
                                             {"config_class": CPUCriticConfig}))
    AutoModelForTokenClassification.register(CPUCriticConfig, CPUCriticModel)
    return CPUCriticConfig


CPUCriticConfig = _critic_classes()


def build_model(path: str, critic: bool = False) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = (CPUCriticConfig if critic else Qwen2Config)(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
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
        prompts[i, PROMPT - p:] = torch.randint(3, VOCAB, (p,), generator=g)
        responses_t[i, :r] = torch.randint(3, VOCAB, (r,), generator=g)
        attention[i, PROMPT - p:PROMPT + r] = 1
    response_mask = attention[:, PROMPT:].clone()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    fields = {
        "prompts": prompts, "responses": responses_t,
        "input_ids": torch.cat([prompts, responses_t], dim=1),
        "attention_mask": attention, "position_ids": position_ids,
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

    common = dict(strategy=strategy, model_dtype="fp32", use_torch_compile=False,
                  mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                   "buffer_dtype": "fp32"},
                  use_dynamic_bsz=True, max_token_len_per_gpu=MAX_TOKENS,
                  infer_max_token_len_per_gpu=MAX_TOKENS, **odc.pop("engine", {}))
    engine = (ODCEngineConfig(**common, **odc) if strategy == "odc"
              else FSDPEngineConfig(**common))
    config = TrainingWorkerConfig(
        model_type="value_model" if critic else "language_model",
        model_config=HFModelConfig(path=model_path, load_tokenizer=False,
                                   use_remove_padding=False,
                                   override_config={"attn_implementation": "eager"}),
        engine_config=engine,
        optimizer_config=FSDPOptimizerConfig(optimizer="SGD", lr=lr, weight_decay=0.0,
                                             clip_grad=10.0, total_training_steps=10),
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

    config = FSDPActorConfig(strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True,
                             entropy_coeff=entropy_coeff, calculate_entropy=True,
                             use_kl_loss=True, kl_loss_coef=0.1, clip_ratio=0.1,
                             fsdp_config=FSDPEngineConfig(strategy="fsdp2"))
    return partial(ppo_loss, config)


def critic_loss():
    from functools import partial

    from verl.workers.config import FSDPCriticConfig
    from verl.workers.utils.losses import value_loss

    config = FSDPCriticConfig(strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True,
                              cliprange_value=0.5)
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


def mini_batch_run(rank, world, strategy, critic, model_path, dispatched, seed, odc):
    """verl's update of one rollout batch: train_mini_batch over the rank's dispatched rows
    (verl's dispatch gives each rank an equal chunk), 2 mini-batches -> 2 optimizer steps."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    if critic:
        model_path = model_path + "-critic"
    worker = make_worker(strategy, critic, model_path, lr=0.5, **odc)
    worker.set_loss_fn(critic_loss() if critic else actor_loss())
    logged, forward = [], []
    for call, responses in enumerate(dispatched):
        whole = make_batch([r for part in responses for r in part], seed + call, critic)
        per_rank = len(responses[0])
        start = sum(len(p) for p in responses[:rank])
        mine = list(range(start, start + len(responses[rank])))
        # As verl's trainer before the update: old log-probs (values) from a forward-only pass
        # of the same engine; under ODC with each rank's own microbatch count, and then the
        # update starts with zero_grad() after that forward.
        probe = rows(whole, mine)
        tu.assign_non_tensor(probe, compute_loss=False, calculate_entropy=True)
        inferred = tu.get(worker.infer_batch(probe), "values" if critic else "log_probs")
        # What verl's trainer keeps of it (no_padding_2_padding: the response positions; the
        # last position of a sequence predicts whatever follows it in its microbatch).
        padded = no_padding_2_padding(inferred, rows(whole, mine))
        forward.append(padded[rows(whole, mine)["response_mask"].bool()].tolist())
        data = rows(whole, mine)
        tu.assign_non_tensor(data, global_batch_size=world * per_rank // 2,
                             mini_batch_size=world * per_rank // 2, epochs=1, seed=7,
                             dataloader_kwargs={"shuffle": False}, calculate_entropy=True)
        logged.append(metrics_of(worker.train_mini_batch(data)))
    steps = list(getattr(worker.engine, "odc_steps", []))
    result = {"metrics": logged, "params": parameters(worker), "steps": steps,
              "forward": forward}
    finish(worker)
    return result


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
        tu.assign_non_tensor(data, global_batch_size=len(whole), calculate_entropy=True,
                             global_token_num=[int(x) for x in data["input_ids"].offsets().diff()])
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
    return {"ref": mini_batch_run(rank, world, "fsdp2", False, model_path, dispatched, 50, {}),
            "odc": fallback_run(rank, world, model_path, dispatched, 50)}


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
        model_config=HFModelConfig(path=model_path, load_tokenizer=False,
                                   override_config={"attn_implementation": "eager"}),
        engine_config=ODCEngineConfig(strategy="odc", forward_only=True, use_dynamic_bsz=True,
                                      max_token_len_per_gpu=MAX_TOKENS,
                                      infer_max_token_len_per_gpu=MAX_TOKENS),
        optimizer_config=None, checkpoint_config=CheckpointConfig())
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
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")  # verl's Worker reads these; the group already exists


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
    timed("mini_odc", mini_batch_run, rank, world, "odc", False, model_path, mini_data, 40,
          {"odc_balance": "mini", "odc_cost": "verl"})
    critic_data = [UNEVEN]
    timed("critic_ref", mini_batch_run, rank, world, "fsdp2", True, model_path, critic_data, 20, {})
    timed("critic_odc", mini_batch_run, rank, world, "odc", True, model_path, critic_data, 20, {})
    # Six sequences: verl's equalized run gets 3 and 3, ODC's rank 1 a single short one.
    timed("single_ref", train_batch_run, rank, world, "fsdp2", model_path, SINGLE,
          [[0, 1, 2], [3, 4, 5]], 30, {})
    timed("single_odc", train_batch_run, rank, world, "odc", model_path, SINGLE,
          [[0, 1, 3, 4, 5], [2]], 30, {})
    # Ranks on two hosts (ODC_HOST_ID): attach keeps FSDP2's collectives, and the engine runs
    # verl's own path (equal counts) instead of ODC's.
    os.environ["ODC_HOST_ID"] = f"host{rank}"
    try:
        timed("hosts_odc", fallback_run, rank, world, model_path, actor_data, 10)
    finally:
        del os.environ["ODC_HOST_ID"]
    out["reference"] = reference_engine(model_path)
    out["refused_sp"] = refused(model_path, ulysses_sequence_parallel_size=2)
    out["refused_offload"] = refused(model_path, offload_policy=True)
    out["timings"] = timings
    return out


def main() -> None:
    from multiproc import run_ranks

    target = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="odc-verl-") as tmp:
        model_path = os.path.join(tmp, "model")
        build_model(model_path)
        build_model(model_path + "-critic", critic=True)
        t0 = time.perf_counter()
        results = run_ranks(2, ranks, model_path, backend="gloo", timeout=600.0,
                            pg_timeout=120.0)
        single = run_ranks(1, one_rank, model_path, backend="gloo", timeout=300.0,
                           pg_timeout=120.0)[0]
        wall = time.perf_counter() - t0
    import torch
    import transformers
    import verl

    import torch_odc

    versions = {"verl": verl.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__, "torch_odc": torch_odc.__file__}
    with open(target, "w") as f:
        json.dump({"ranks": results, "one_rank": single, "wall_s": wall,
                   "versions": versions}, f)


if __name__ == "__main__":
    main()
