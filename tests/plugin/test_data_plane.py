"""The data plane's promises, counted on real gloo ranks: one message each way per (layer, stage,
Attention rank, FFN rank); no host read on the Attention side (direct plane) or exactly the
staged plane's one read of its host copy; a combine whose float32 sums do not depend on the
wire order; frames every rank agrees on; each rank process on its own device."""

import threading
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import afd_shared_experts.device as device_module
from afd_shared_experts import ops
from afd_devcluster import free_port
from afd_devcluster.checkpoints import write_moe_checkpoint
from afd_shared_experts.compute import route
from afd_shared_experts.device import select_device
from afd_shared_experts.errors import AFDError
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.selfcheck import token_range
from plugin_harness import ThreadWorld, assert_matches_oracle, make_connector, oracle_outputs, run_threads

# Ops whose results the host must read (or whose output shape depends on data): each one a
# stream sync on an accelerator.
HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                 "unique_dim", "repeat_interleave", "equal", "is_nonzero"}


class HostReads(TorchDispatchMode):
    """Counts, in the thread that enters it, every aten op that reads tensor data on the host."""

    def __init__(self):
        super().__init__()
        self.reads = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READ_OPS:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


class CountingTransport:
    """transport_wrapper: every isend/irecv of every rank, by (rank, link, kind, peer)."""

    def __init__(self):
        self.posts = Counter()
        self._links_seen = Counter()
        self._lock = threading.Lock()

    def __call__(self, inner):
        rank = inner.process_group.rank()
        with self._lock:
            link = ("work", "reply")[self._links_seen[rank]]  # the connector builds its links in this order
            self._links_seen[rank] += 1
        counter = self

        class Counted:
            def isend(self, tensor, dst, tag):
                counter.count(rank, link, "send", dst)
                return inner.isend(tensor, dst, tag)

            def irecv(self, tensor, src, tag):
                counter.count(rank, link, "recv", src)
                return inner.irecv(tensor, src, tag)

        return Counted()

    def count(self, rank, link, kind, peer):
        with self._lock:
            self.posts[(rank, link, kind, peer)] += 1


def staged_forward(world, a, x, stages):
    """Attention rank a's forward of every MoE layer in ``stages`` micro-batches, all dispatched
    before the first combine; host reads of the whole forward counted."""
    parts = [x[slice(*token_range(s, x.shape[0], stages))] for s in range(stages)]
    routes = {layer: [route(world.spec, moe.gate, part) for part in parts] for layer, moe in world.layers[a].items()}
    outs = {}
    with HostReads() as reads:
        for layer, moe in world.layers[a].items():
            pendings = [moe.remote.dispatch(part, *routes[layer][s], stage=s, stages=stages)
                        for s, part in enumerate(parts)]
            outs[layer] = torch.cat([moe.remote.combine(pending) for pending in pendings])
    return outs, reads.reads


@pytest.mark.parametrize("data_plane", ["direct", "staged"])
def test_messages_per_peer_and_layer_stage_and_no_attention_side_host_sync(checkpoints, data_plane,
                                                                                      monkeypatch):
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    attention_ranks, ffn_ranks, layers = 2, 2, len(spec.moe_layers)
    tolist_calls = Counter()
    real_tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        tolist_calls[threading.get_ident()] += 1
        return real_tolist(tensor)

    counting = CountingTransport()
    with ThreadWorld(model_dir, attention_ranks, ffn_ranks, placement="ffn", transport_wrapper=counting,
                     data_plane=data_plane) as world:
        for runtime in world.runtimes:
            runtime.gather_window = 30.0
        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
        for stages, tokens in ((1, 0), (1, 7), (2, 9), (2, 16)):
            before = Counter(counting.posts)
            xs = [torch.randn(tokens + a, spec.hidden_size) for a in range(attention_ranks)]
            idents = {}

            def rank_job(a):
                idents[a] = threading.get_ident()
                tolist_calls[idents[a]] = 0
                return staged_forward(world, a, xs[a], stages)

            results = run_threads([lambda a=a: rank_job(a) for a in range(attention_ranks)], timeout=60)
            for a, (outs, reads) in enumerate(results):
                if tokens + a:
                    assert_matches_oracle(outs, oracle_outputs(model_dir, xs[a], "float32", spec.moe_layers), "float32")
                # Direct: nothing read on the host. Staged: the frames' row counts, once per dispatch,
                # from the host copy the plane sends anyway.
                expected = 0 if data_plane == "direct" else layers * stages
                assert tolist_calls[idents[a]] == expected, (a, tolist_calls[idents[a]])
                assert sum(reads.values()) == 0, reads
            posted = counting.posts - before
            # Work: one message per dispatch on staged; on direct the header, then the rows of the
            # size the header's token count gives (the FFN rank posts that receive once it read it).
            work_messages = 2 if data_plane == "direct" else 1
            for a in range(attention_ranks):
                dispatches = layers * stages
                for f in range(attention_ranks, attention_ranks + ffn_ranks):
                    assert posted[(a, "work", "send", f)] == work_messages * dispatches
                    assert posted[(a, "reply", "recv", f)] == dispatches
                    # ...and the FFN rank answers each with one reply (its next work receive is
                    # posted when a frame arrives).
                    assert posted[(f, "reply", "send", a)] == dispatches
                    assert posted[(f, "work", "recv", a)] == work_messages * dispatches
            assert {key[1:3] for key in posted} == {("work", "send"), ("reply", "recv"), ("reply", "send"),
                                                    ("work", "recv")}


def test_attention_sends_are_completed_by_their_replies_not_by_watcher_threads(checkpoints):
    """gloo reports a send's completion only through a blocking wait, which would take a watcher
    thread per peer (a thread switch per message on a rank pinned to one core). An FFN rank
    replies only after it received the whole frame, so the reply completes the send: the
    Attention rank watches its reply receives only, and its frames go back to use once answered."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    x = torch.randn(6, spec.hidden_size)
    with ThreadWorld(model_dir, 1, 2, placement="ffn") as world:
        for _ in range(3):
            assert_matches_oracle(world.run(x), oracle_outputs(model_dir, x, "float32", spec.moe_layers), "float32")
        names = {thread.name for thread in threading.enumerate()}
        assert {name for name in names if name.startswith("afd-0-")} == {"afd-0-reply-1", "afd-0-reply-2"}
        connector = world.attention_connectors[0]
        assert connector.pending_dispatches() == 0 and connector.sends_in_flight() == 0


class OpsUsed(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        accumulates = func.overloadpacket.__name__ == "index_put" and (kwargs.get("accumulate") or
                                                                        (len(args) > 3 and args[3]))
        self.ops.append(func.overloadpacket.__name__ + ("(accumulate)" if accumulates else ""))
        return func(*args, **kwargs)


# Accumulating scatters: on CUDA/NPU they add with atomics in whatever order the threads run,
# so the same step rounds differently from run to run.
ACCUMULATING_OPS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                    "index_put(accumulate)", "index_put_(accumulate)", "index_reduce", "index_reduce_"}


def test_combine_sums_in_slot_order_without_atomics_whatever_the_ffn_split(tmp_path):
    """Top-4 routing: the combine gathers each token's expert outputs into its (token, slot) rows
    and sums over the slots; no accumulating scatter (atomics on an accelerator), and F = 1, 2
    and 4 FFN ranks give the same bits (placement 'attention': a shared expert split over F ranks
    runs GEMMs of other sizes, which round differently)."""
    model_dir = write_moe_checkpoint(tmp_path / "top4", "deepseek_v3", seed=3, top_k=4, n_group=1, topk_group=1)
    spec = load_spec(model_dir)
    x = torch.randn(24, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    outputs = []
    for ffn_ranks in (1, 2, 4):
        with ThreadWorld(model_dir, 1, ffn_ranks, placement="attention") as world:
            outputs.append(world.run(x))
            moe = world.layers[0][spec.moe_layers[0]]
            pending = moe.remote.dispatch(x, *route(spec, moe.gate, x))
            with OpsUsed() as used:
                moe.remote.combine(pending)
            assert not ACCUMULATING_OPS.intersection(used.ops), used.ops
            assert "sum" in used.ops
    for layer in spec.moe_layers:
        assert torch.equal(outputs[0][layer], outputs[1][layer]) and torch.equal(outputs[0][layer], outputs[2][layer])
    assert_matches_oracle(outputs[0], oracle_outputs(model_dir, x, "float32", spec.moe_layers), "float32")


def test_ranks_with_different_frames_are_refused_at_rendezvous(checkpoints):
    spec = load_spec(checkpoints["deepseek_v3"])
    port = free_port()
    attention = make_connector(spec, "attention", 0, 1, 1, port, timeout=10, max_tokens=64)
    ffn = make_connector(spec, "ffn", 1, 1, 1, port, timeout=10, max_tokens=32)
    errors = []

    def init(connector):
        try:
            connector.init()
        except ValueError as exc:
            errors.append(str(exc))
        finally:
            connector.close()

    run_threads([lambda c=c: init(c) for c in (attention, ffn)], timeout=30)
    assert len(errors) == 2
    assert all("AFD frame layout: every rank of the world must use the same model and --max-num-batched-tokens"
               in error and "max tokens 32" in error and "max tokens 64" in error for error in errors)


def test_each_rank_process_selects_its_own_device(monkeypatch):
    """A rank on device index i makes i the current device (the communicators and vLLM's
    layers allocate on the current one); a CPU rank selects nothing."""
    selected = []
    monkeypatch.setattr(device_module.torch.accelerator, "set_device_index", selected.append)
    select_device(torch.device("cuda", 1))
    select_device(torch.device("cuda", 3))
    select_device(torch.device("cpu"))
    assert selected == [1, 3]


@contextmanager
def one_registered_layer(model_dir, prefix: str):
    """(spec, world, layer, name): a 1 Attention x 2 FFN world whose first MoE layer the custom
    ops call as ``{prefix}.layers.{layer}``."""
    spec = load_spec(model_dir)
    with ThreadWorld(model_dir, 1, 2, placement="ffn") as world:
        layer = spec.moe_layers[0]
        name = f"{prefix}.layers.{layer}"
        ops.register_remote_moe(name, world.layers[0][layer].remote)
        yield spec, world, world.layers[0][layer], name


def test_custom_ops_compile_whole_and_keep_dispatch_before_combine(checkpoints):
    """``afd::dispatch`` / ``afd::combine`` in a function torch.compile traces whole
    (fullgraph: no graph break, so no host read in the traced part), on real ranks: the
    compiled layer gives the eager layer's outputs, stage by stage."""
    with one_registered_layer(checkpoints["qwen2_moe"], "test") as (spec, world, moe, name):
        def forward(x):
            ids, weights = route(spec, moe.gate, x)
            return ops.remote_moe(x, [ids, weights], name) * 2

        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager", dynamic=True)
        for tokens in (5, 9, 1):
            x = torch.randn(tokens, spec.hidden_size)
            assert torch.equal(compiled(x), moe.forward(x) * 2)
        served = sum(r.items_served for r in world.runtimes)
    assert served == 2 * 2 * 3  # each call dispatched once to each FFN rank


@pytest.mark.parametrize("failed_at", [0, 1])
def test_a_step_that_failed_between_dispatch_and_combine_leaves_nothing_behind(checkpoints, caplog, failed_at):
    """An exception after a layer's ``afd::dispatch`` and before its ``afd::combine`` (a failed
    step), at the first or a later MoE layer: the next step's dispatches drain the abandoned
    one, its outputs are its own, and no frame set is lost."""
    model_dir = checkpoints["qwen2_moe"]
    spec = load_spec(model_dir)
    assert len(spec.moe_layers) == 2
    with ThreadWorld(model_dir, 1, 2, placement="ffn") as world:
        connector, layers = world.attention_connectors[0], world.layers[0]
        names = {l: f"failing{failed_at}.layers.{l}" for l in spec.moe_layers}
        for l, name in names.items():
            ops.register_remote_moe(name, layers[l].remote)

        def step(x, fail_at=None):
            outputs = {}
            for index, (l, name) in enumerate(names.items()):
                if index == fail_at:
                    torch.ops.afd.dispatch(x, list(route(spec, layers[l].gate, x)), name)
                    return None  # the step fails here
                outputs[l] = ops.remote_moe(x, list(route(spec, layers[l].gate, x)), name)
            return outputs

        step(torch.randn(6, spec.hidden_size, generator=torch.Generator().manual_seed(1)), fail_at=failed_at)
        for tokens in (3, 8):
            x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
            outputs = step(x)
            for l in spec.moe_layers:
                assert torch.equal(outputs[l], layers[l].forward(x))
        assert connector.pending_dispatches() == 0 and connector.sends_in_flight() == 0
        assert len(connector._pool._free) == connector.frame_sets
    assert "was never combined; its replies are drained" in caplog.text


def test_the_frame_pool_is_made_once_and_never_grows(checkpoints):
    """An Attention rank's frame sets are allocated at init (num_stages + spare) and reused
    over 1,000 steps of two stages; a dispatch beyond the pool is refused, naming it."""
    model_dir = checkpoints["deepseek_v2"]
    spec = load_spec(model_dir)
    with ThreadWorld(model_dir, 1, 1, placement="ffn") as world:
        connector = world.attention_connectors[0]
        initial = {id(frames) for frames in connector._pool._free}
        assert len(initial) == connector.frame_sets == 3
        moe = world.layers[0][spec.moe_layers[0]]
        x = torch.randn(4, spec.hidden_size, generator=torch.Generator().manual_seed(0))
        halves = [x[:2], x[2:]]
        for _ in range(1000):
            pending = [moe.remote.dispatch(half, *route(spec, moe.gate, half), stage=stage, stages=2)
                       for stage, half in enumerate(halves)]
            assert {id(p_) for p_ in connector._pool._free} < initial
            outputs = [moe.remote.combine(p_) for p_ in pending]
        torch.testing.assert_close(torch.cat(outputs), moe.forward(x))  # rows grouped 2+2 vs 4: rounding
        assert {id(frames) for frames in connector._pool._free} == initial
        held = [connector.acquire() for _ in range(3)]
        with pytest.raises(AFDError, match=r"rank 0: all 3 frame sets hold dispatches not yet combined"):
            connector.acquire()
        for frames in held:
            connector.release(frames)


def test_custom_ops_have_shape_only_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 16, dtype=torch.bfloat16)
        token = torch.ops.afd.dispatch(x, [torch.empty(7, 2, dtype=torch.int64), torch.empty(7, 2)], "unregistered")
        out = torch.ops.afd.combine(token, x, "unregistered")
    assert token.shape == (0,) and (out.shape, out.dtype) == ((7, 16), torch.bfloat16)
    with pytest.raises(KeyError, match="no remote MoE layer registered as 'unregistered'"):
        torch.ops.afd.dispatch(torch.zeros(1, 4), [torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)], "unregistered")
