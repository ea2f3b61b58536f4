"""Test helpers: the HF transformers oracle, in-process ranks, fault injection, process checks.
(The tiny checkpoints come from afd_devcluster.checkpoints.)"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from afd_devcluster import free_port
from afd_shared_experts.device import select_device
from afd_shared_experts.model import DTYPES
from afd_shared_experts.moe_spec import GATE_SIGMOID_GROUPED, load_spec

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


# model_type -> (transformers module, config class, MoE module class). Kimi-K2 ships its own
# config code; its MoE is DeepSeek-V3's, which transformers' DeepseekV3 classes compute.
ORACLE_CLASSES = {
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Config", "DeepseekV2Moe"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE"),
    "kimi_k2": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE"),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32Config", "DeepseekV32MoE"),
    "glm4_moe": ("glm4_moe", "Glm4MoeConfig", "Glm4MoeMoE"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"),
}


def oracle_module(model_dir: Path, layer: int, dtype: str):
    """The HF transformers MoE module of ``layer`` with the checkpoint's weights."""
    import importlib

    from safetensors import safe_open

    spec = load_spec(model_dir)
    package, config_name, module_name = ORACLE_CLASSES[spec.model_type]
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    configuration = importlib.import_module(f"transformers.models.{package}.configuration_{package}")
    cfg = getattr(configuration, config_name).from_pretrained(str(model_dir))
    module = getattr(modeling, module_name)(cfg)
    base = f"model.layers.{layer}.mlp"
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        get = f.get_tensor
        with torch.no_grad():
            module.gate.weight.copy_(get(f"{base}.gate.weight"))
            if spec.gate_kind == GATE_SIGMOID_GROUPED:
                module.gate.e_score_correction_bias.copy_(get(f"{base}.gate.e_score_correction_bias"))
            for e in range(module.experts.gate_up_proj.shape[0]):
                p = f"{base}.experts.{e}"
                module.experts.gate_up_proj[e].copy_(torch.cat([get(f"{p}.gate_proj.weight"), get(f"{p}.up_proj.weight")]))
                module.experts.down_proj[e].copy_(get(f"{p}.down_proj.weight"))
            if spec.has_shared_experts:
                shared = getattr(module, spec.shared_prefix)
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    getattr(shared, proj).weight.copy_(get(f"{base}.{spec.shared_prefix}.{proj}.weight"))
            if spec.has_shared_gate:
                module.shared_expert_gate.weight.copy_(get(f"{base}.shared_expert_gate.weight"))
    return module.to(DTYPES[dtype]).eval()


def oracle_outputs(model_dir: Path, hidden_states: torch.Tensor, dtype: str, layers) -> dict[int, torch.Tensor]:
    outputs = {}
    for layer in layers:
        module = oracle_module(model_dir, layer, dtype)
        x = hidden_states.to(DTYPES[dtype])
        with torch.no_grad():
            outputs[layer] = module(x.unsqueeze(0)).squeeze(0).float() if x.shape[0] else torch.zeros(0, x.shape[1])
    return outputs


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12))


def assert_matches_oracle(actual: dict, expected: dict, dtype: str) -> None:
    assert sorted(actual) == sorted(expected)
    for layer in expected:
        assert actual[layer].shape == expected[layer].shape, (layer, actual[layer].shape, expected[layer].shape)
        error = relative_error(actual[layer], expected[layer])
        assert error <= TOLERANCE[dtype], f"layer {layer}: relative error {error:.3g} > {TOLERANCE[dtype]} ({dtype})"


def run_threads(targets: list, timeout: float = 120.0) -> list:
    """Run callables in threads (each builds its own rank); return results, re-raise the first error."""
    results: list = [None] * len(targets)
    errors: list = []

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} rank thread(s) still running after {timeout}s"
    return results


# The token budget of the test worlds: frames hold this many tokens per dispatch.
MAX_TOKENS = 512

# How long a test world's ranks may take to join. Generous on purpose: on a loaded two-core
# machine a rank's join can lag by seconds, and a test about liveness (short ``timeout``) must
# not fail at the rendezvous instead; tests about the rendezvous pass their own bound.
RENDEZVOUS_TIMEOUT = 60.0


def make_connector(spec, role: str, rank: int, attention_ranks: int, ffn_ranks: int, port: int, *,
                   timeout: float, rendezvous_timeout: float = RENDEZVOUS_TIMEOUT, dtype: torch.dtype = torch.float32,
                   placement: str = "ffn", partition: str = "affinity", max_tokens: int = MAX_TOKENS, **options):
    """One rank's P2PConnector on loopback, built as the plugin builds it: from an AFDConfig.
    ``timeout`` bounds every wait on a peer once the world is up, ``rendezvous_timeout`` the join."""
    from afd_shared_experts.config import AFDConfig, SharedExpertsConfig
    from afd_shared_experts.connector import P2PConnector
    from afd_shared_experts.wire import WireLayout

    cfg = AFDConfig(role=role, num_attention_ranks=attention_ranks, num_ffn_ranks=ffn_ranks, host="127.0.0.1",
                    port=port, timeout_seconds=timeout,
                    rendezvous_timeout_seconds=rendezvous_timeout,
                    shared_experts=SharedExpertsConfig(placement, partition))
    layout = WireLayout.for_world(spec, cfg, dtype=dtype, token_budget=max_tokens)
    return P2PConnector.from_config(cfg, role=role, rank=rank, layout=layout, **options)


# Enough of a model spec for connectors that only rendezvous (no checkpoint, no payload).
RENDEZVOUS_ONLY_SPEC = SimpleNamespace(hidden_size=8, top_k=2, local_experts=lambda ffn_ranks: 2,
                                       placement=lambda requested: requested)


def connected(model_dir, attention_ranks: int, ffn_ranks: int, timeout: float = 10.0, dtype=torch.float32, *,
              with_metrics: bool = False, **options):
    """(spec, connectors) of an initialized world over loopback: Attention ranks first, as threads;
    ``options`` go to ``make_connector``, ``with_metrics`` gives each rank a RuntimeMetrics. If
    any rank fails to join, every connector is closed before the error propagates."""
    from afd_shared_experts.metrics import RuntimeMetrics

    spec = load_spec(model_dir)
    port = free_port()
    made = []
    for rank in range(attention_ranks + ffn_ranks):
        role = "attention" if rank < attention_ranks else "ffn"
        made.append(make_connector(spec, role, rank, attention_ranks, ffn_ranks, port, timeout=timeout, dtype=dtype,
                                   metrics=RuntimeMetrics(role) if with_metrics else None, **options))
    try:
        # Each rank's init on a thread that selected its device, as a rank's main thread does (an FFN
        # rank posts its first receives there).
        run_threads([lambda c=c: (select_device(c.device), c.init()) for c in made], timeout=RENDEZVOUS_TIMEOUT + 10)
    except BaseException:
        for c in made:
            c.close()
        raise
    return spec, made


class ThreadWorld:
    """A + F real ranks (gloo over loopback) as threads of the test process: one rendezvous,
    then any number of steps. Cheaper than processes, same code paths."""

    def __init__(self, model_dir, attention_ranks: int, ffn_ranks: int, *, placement: str = "ffn",
                 partition: str = "affinity", dtype: str = "float32", timeout: float = 20.0,
                 transport_wrapper=None, with_metrics: bool = False, data_plane: str | None = None,
                 max_tokens: int = MAX_TOKENS, link_transport=None):
        from afd_shared_experts.attention import AttentionMoELayer, RemoteMoE
        from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
        from afd_shared_experts.model import load_attention_weights, load_ffn_weights

        self.attention_ranks, self.ffn_ranks, self.dtype = attention_ranks, ffn_ranks, dtype
        torch_dtype = DTYPES[dtype]
        spec, connectors = connected(
            model_dir, attention_ranks, ffn_ranks, timeout, torch_dtype, with_metrics=with_metrics, placement=placement,
            partition=partition, max_tokens=max_tokens, transport_wrapper=transport_wrapper, data_plane=data_plane,
            link_transport=link_transport)
        self.spec = spec
        self.attention_connectors, self.ffn_connectors = connectors[:attention_ranks], connectors[attention_ranks:]
        self.attention_weights = [load_attention_weights(model_dir, spec, placement, torch_dtype)
                                  for _ in range(attention_ranks)]
        self.ffn_weights = [load_ffn_weights(model_dir, spec, placement, f, ffn_ranks, torch_dtype)
                            for f in range(ffn_ranks)]
        self.layers = [
            {l: AttentionMoELayer(w.gate, RemoteMoE(spec=spec, layer=l, connector=c, num_ffn_ranks=ffn_ranks,
                                                    placement=placement, partition=partition, dtype=torch_dtype,
                                                    shared=w.shared, metrics=c.metrics))
             for l, w in weights.items()}
            for c, weights in zip(self.attention_connectors, self.attention_weights)
        ]
        self.runtimes = [FFNRuntime(c, torch_experts(w), metrics=c.metrics).start()
                         for c, w in zip(self.ffn_connectors, self.ffn_weights)]

    def run(self, hidden_states: torch.Tensor, *, model_units: bool = True) -> dict[int, torch.Tensor]:
        """Every MoE layer on the same input, tokens split contiguously across Attention ranks."""
        from afd_shared_experts.selfcheck import token_range

        num_tokens = hidden_states.shape[0]

        def rank_job(a):
            x = hidden_states[slice(*token_range(a, num_tokens, self.attention_ranks))]
            return {l: layer.forward(x) for l, layer in self.layers[a].items()}

        per_rank = run_threads([lambda a=a: rank_job(a) for a in range(self.attention_ranks)])
        scale = self.spec.routed_scaling_factor if (self.dtype == "float16" and model_units) else 1.0
        return {l: torch.cat([r[l].float() for r in per_rank]) * scale for l in self.spec.moe_layers}

    def close(self, timeout: float = 20.0) -> None:
        """Attention ranks send shutdown notices; FFN loops must end by themselves."""
        for c in self.attention_connectors:
            c.close()
        errors = []
        for runtime in self.runtimes:
            try:
                runtime.join(timeout)
            except BaseException as exc:
                errors.append(exc)
            runtime.connector.close()
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (frames carry int32 headers in float rows: a NaN pattern there
    is data, and torch.equal would call two copies of it different)."""
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


class DelayedCompletionTransport:
    """Fault injector: completions arrive late. Receives land in a staging buffer and reach
    the caller's tensor only at completion (the caller's tensor is poisoned until then);
    sends are read ``delay`` seconds after their post, in post order, by a sender thread (a
    transport progressing in the background), which records a violation if the tensor changed
    since the post. A connector that reads early or reuses a buffer in flight produces wrong
    numbers or violations."""

    def __init__(self, inner, delay: float = 0.002):
        self.inner, self.delay = inner, delay
        self.violations: list[str] = []
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send_late, name="delayed-sender", daemon=True).start()

    def _send_late(self) -> None:
        while True:
            due, tensor, snapshot, dst, tag, posted = self._sends.get()
            time.sleep(max(0.0, due - time.monotonic()))
            if not same_bytes(tensor, snapshot):
                self.violations.append(f"send to {dst} tag {tag}: buffer modified while in flight")
            posted.append(self.inner.isend(tensor, dst, tag))

    def isend(self, tensor, dst, tag):
        posted: list = []
        self._sends.put((time.monotonic() + self.delay, tensor, tensor.clone(), dst, tag, posted))

        class Handle:
            def wait(self):
                while not posted:
                    time.sleep(0.0005)
                posted[0].wait()

        return Handle()

    def irecv(self, tensor, src, tag):
        staging = torch.empty_like(tensor)
        tensor.fill_(-777 if not tensor.is_floating_point() else float("nan"))
        inner = self.inner.irecv(staging, src, tag)
        transport = self

        class Handle:
            def wait(self):
                inner.wait()
                time.sleep(transport.delay)
                tensor.copy_(staging)

        return Handle()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def attention_rank_that_idles(model_dir, port: int, attention_ranks: int, ffn_ranks: int, rank: int, ready) -> None:
    """Child process body: an Attention rank that joins the world and then does nothing.
    ``ready`` is set once the interpreter is up, so the parent's wait for the rendezvous does
    not count the child's start."""
    torch.set_num_threads(1)
    connector = make_connector(load_spec(model_dir), "attention", rank, attention_ranks, ffn_ranks, port, timeout=3)
    ready.set()
    connector.init()
    time.sleep(600)


def ffn_rank_that_serves(model_dir, port: int, ready) -> None:
    """Child process body: the FFN rank of a 1A1F world serving until its Attention rank
    shuts down; ``ready`` as above."""
    from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
    from afd_shared_experts.model import load_ffn_weights

    torch.set_num_threads(1)
    spec = load_spec(model_dir)
    experts = torch_experts(load_ffn_weights(model_dir, spec, "ffn", 0, 1, torch.float32))
    connector = make_connector(spec, "ffn", 1, 1, 1, port, timeout=3)
    ready.set()
    connector.init()
    FFNRuntime(connector, experts).serve()


def _state_and_parent(stat_file: Path) -> tuple[str, int] | None:
    """(state, ppid) from /proc/PID/stat (fields after the parenthesised command name); None once gone."""
    try:
        state, ppid = stat_file.read_text().rsplit(")", 1)[1].split()[:2]
    except OSError:
        return None
    return state, int(ppid)


def child_pids(pid: int) -> list[int]:
    """Live child processes of `pid` (zombies excluded)."""
    children = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        found = _state_and_parent(stat_file)
        if found is not None and found[0] != "Z" and found[1] == pid:
            children.append(int(stat_file.parent.name))
    return sorted(children)


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    found = _state_and_parent(Path(f"/proc/{pid}/stat"))
    return found is not None and found[0] != "Z"
