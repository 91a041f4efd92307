"""The machine-wide shared-memory embedding cache (`cache.shm`): round trips, LRU, a model-checked state machine,
persistence across processes, crash recovery after SIGKILL, and a multi-process stress run with random kills."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cache import shm_layout as L
from cache.shm import ShmEmbeddingCache
from cache.shm_arena import Arena
from cache.shm_layout import block_bytes

KB = 1024


@pytest.fixture
def name() -> Iterator[str]:
    arena = f"mmenc-test-{uuid.uuid4().hex[:12]}"
    yield arena
    if os.path.exists(f"/dev/shm/{arena}"):
        os.unlink(f"/dev/shm/{arena}")


@pytest.fixture(scope="module")
def forkserver() -> mp.context.ForkServerContext:
    """Children forked from a server that has torch and this module imported: they start in milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "cache.shm", __name__])
    return ctx


def check_arena(cache: ShmEmbeddingCache) -> None:
    """Walk the whole arena and assert every structural invariant (call between operations, not during)."""
    assert cache._lock(5.0)
    try:
        a: Arena = cache._arena  # type: ignore[assignment]
        w = a.w
        assert w[L.A_DIRTY] == 0 and w[L.A_PENDING_OFF] == 0
        chain, off, prev, prev_free = {}, a.data_off, 0, False
        while off < a.data_end:
            b = off >> 3
            tag, size = w[b + L.B_TAG], w[b + L.B_SIZE]
            assert tag in (L.TAG_FREE, L.TAG_VALID), f"block {off}: tag {tag:#x}"
            assert size >= L.MIN_BLOCK_BYTES and size % L.ALIGN == 0 and w[b + L.B_PREV_PHYS] == prev
            assert not (prev_free and tag == L.TAG_FREE), "two adjacent free blocks"
            chain[off] = (tag, size)
            prev, prev_free, off = off, tag == L.TAG_FREE, off + size
        assert off == a.data_end
        free_listed = set()
        for c in range(L.NUM_SIZE_CLASSES):
            o, back = w[L.A_FREE_HEADS + c], 0
            assert bool(o) == bool(w[L.A_FREE_BITMAP] >> c & 1)
            while o:
                assert chain[o][0] == L.TAG_FREE and chain[o][1].bit_length() - 1 == c
                assert w[(o >> 3) + L.B_PREV] == back
                free_listed.add(o)
                back, o = o, w[(o >> 3) + L.B_NEXT]
        valid = {o for o, (tag, _) in chain.items() if tag == L.TAG_VALID}
        assert free_listed == set(chain) - valid
        lru, o, back = [], w[L.A_LRU_HEAD], 0
        while o:
            assert w[(o >> 3) + L.B_PREV] == back
            lru.append(o)
            back, o = o, w[(o >> 3) + L.B_NEXT]
        assert back == w[L.A_LRU_TAIL] and len(lru) == len(set(lru)) and set(lru) == valid
        assert all(a.find(a.key_at(o), w[(o >> 3) + L.B_HASH]) == o for o in valid)
        assert sum(1 for i in range(a.num_buckets) if w[a.table_w + i]) == len(valid) == w[L.A_ENTRIES]
        assert w[L.A_BYTES_USED] == sum(chain[o][1] for o in valid) <= a.capacity
    finally:
        cache._unlock()


# ----------------------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int32,
                                   torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4), (2, 3, 4, 5)])
def test_round_trip_is_exact(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=gen) * 100).to(dtype)
    with ShmEmbeddingCache(name, 256 * KB) as cache:
        assert cache.put("k", t)
        got = cache.get("k")
        assert got is not None and got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))  # bit-exact


def test_non_contiguous_and_grad_inputs_are_stored_as_values(name: str) -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    with ShmEmbeddingCache(name, 64 * KB) as cache:
        assert cache.put("t", x.t()) and torch.equal(cache.get("t"), x.t())  # type: ignore[arg-type]
        assert cache.put("g", x.clone().requires_grad_()) and torch.equal(cache.get("g"), x)  # type: ignore[arg-type]


def test_miss_contains_stats_clear(name: str) -> None:
    with ShmEmbeddingCache(name, 64 * KB) as cache:
        assert cache.get("nope") is None and not cache.contains("nope")
        assert cache.put("a", torch.ones(100)) and cache.put("b", torch.zeros(10, dtype=torch.int64))
        assert cache.contains("a") and cache.get("a") is not None and cache.get("a") is not None
        s = cache.stats()
        assert (s["hits"], s["misses"], s["puts"], s["put_failures"], s["entries"]) == (2, 1, 2, 0, 2)
        assert s["bytes_used"] == block_bytes(400) + block_bytes(80) and s["capacity_bytes"] == 64 * KB
        cache.clear()
        assert cache.get("a") is None and not cache.contains("b")
        s = cache.stats()
        assert (s["entries"], s["bytes_used"], s["puts"], s["misses"]) == (0, 0, 2, 2)
        check_arena(cache)


def test_rejects_bad_keys_dtypes_and_names(name: str) -> None:
    with ShmEmbeddingCache(name, 64 * KB) as cache:
        assert cache.put("x" * 64, torch.ones(1))
        with pytest.raises(ValueError):
            cache.put("x" * 65, torch.ones(1))
        with pytest.raises(ValueError):
            cache.get("")
        with pytest.raises(TypeError):
            cache.put("c", torch.ones(2, dtype=torch.complex64))
        with pytest.raises(ValueError):
            cache.put("5d", torch.ones(1, 1, 1, 1, 1))
    with pytest.raises(ValueError):
        ShmEmbeddingCache("../etc/passwd", 64 * KB)


def test_too_big_for_capacity_is_refused(name: str) -> None:
    with ShmEmbeddingCache(name, 64 * KB) as cache:
        assert cache.put("small", torch.ones(10))
        assert not cache.put("big", torch.ones(16 * KB))  # 64 KiB of payload + its header > capacity
        assert cache.put("fits", torch.ones((64 * KB - L.BLOCK_HEADER_BYTES) // 4))  # exactly the capacity
        assert cache.get("big") is None and cache.get("small") is None  # evicted to make room for "fits"
        s = cache.stats()
        assert s["put_failures"] == 1 and s["bytes_used"] == s["capacity_bytes"] and s["evictions"] == 1
        check_arena(cache)


def test_lru_order_get_protects_an_entry(name: str) -> None:
    n = 8
    with ShmEmbeddingCache(name, n * block_bytes(1000 * 4)) as cache:
        for i in range(n):
            assert cache.put(f"k{i}", torch.full((1000,), float(i)))
        assert cache.get("k0") is not None  # k0 becomes the most recent; k1 is now the oldest
        assert cache.put("k8", torch.full((1000,), 8.0))
        assert cache.contains("k0") and not cache.contains("k1") and cache.contains("k2")
        assert cache.put("k9", torch.full((1000,), 9.0))
        assert not cache.contains("k2") and cache.contains("k0")
        s = cache.stats()
        assert s["evictions"] == 2 and s["entries"] == n and s["bytes_used"] <= s["capacity_bytes"]
        check_arena(cache)


def test_replacing_a_key_keeps_one_entry_and_evicts_nobody(name: str) -> None:
    with ShmEmbeddingCache(name, 2 * block_bytes(400)) as cache:
        assert cache.put("a", torch.ones(100)) and cache.put("b", torch.ones(100))
        assert cache.put("a", torch.full((100,), 2.0))
        assert torch.equal(cache.get("a"), torch.full((100,), 2.0)) and cache.contains("b")  # type: ignore[arg-type]
        assert cache.stats()["entries"] == 2 and cache.stats()["evictions"] == 0


def test_max_entries_bounds_the_entry_count(name: str) -> None:
    with ShmEmbeddingCache(name, 64 * KB, max_entries=4) as cache:
        for i in range(10):
            assert cache.put(f"k{i}", torch.ones(1))
        assert [cache.contains(f"k{i}") for i in range(10)] == [False] * 6 + [True] * 4
        check_arena(cache)


def _overwrite_and_evict(name: str, key: str) -> None:
    """Child: overwrite `key`, then flood the arena until that entry is evicted and its bytes reused."""
    with ShmEmbeddingCache(name, 0, create=False) as cache:
        cache.put(key, torch.zeros(1000, dtype=torch.int32))
        for i in range(40):
            cache.put(f"other{i}", torch.full((1000,), -1, dtype=torch.int32))
        os._exit(0 if not cache.contains(key) else 3)


def test_a_returned_tensor_is_a_private_copy(name: str, forkserver: mp.context.ForkServerContext) -> None:
    with ShmEmbeddingCache(name, 64 * KB) as cache:
        cache.put("k", torch.arange(1000, dtype=torch.int32))
        got = cache.get("k")
        assert got is not None
        child = forkserver.Process(target=_overwrite_and_evict, args=(name, "k"))
        child.start()
        child.join(30)
        assert child.exitcode == 0 and not cache.contains("k")
    assert torch.equal(got, torch.arange(1000, dtype=torch.int32))  # unchanged, also after close()


def test_attach_checks_what_it_finds(name: str) -> None:
    path = f"/dev/shm/{name}"
    open(path, "wb").close()  # a creator that died before initialising the arena
    assert not ShmEmbeddingCache.exists(name)
    with pytest.raises(FileNotFoundError):
        ShmEmbeddingCache(name, 0, create=False)
    with ShmEmbeddingCache(name, 64 * KB) as cache:  # create=True initialises it
        assert cache.put("k", torch.ones(3)) and ShmEmbeddingCache.exists(name)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(b"not an arena" * 1000)
    with pytest.raises(FileExistsError):  # an OSError, like a /dev/shm too small: callers can run without
        ShmEmbeddingCache(name, 64 * KB)
    assert not ShmEmbeddingCache.exists(name)


def test_threads_of_one_process_share_an_instance(name: str) -> None:
    errors: list[str] = []
    with ShmEmbeddingCache(name, 256 * KB) as cache:
        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(300):
                kid, ver = rng.randrange(16), rng.randrange(1000)
                if rng.random() < 0.5:
                    cache.put(f"k{kid}", stress_value(kid, ver))
                elif (got := cache.get(f"k{kid}")) is not None and not is_stress_value(got, kid):
                    errors.append(f"k{kid}")
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check_arena(cache)
    assert not errors


# ----------------------------------------------------------------------------------------------- model-checked
class UniformSizeLRU(RuleBasedStateMachine):
    """Entries of one size pack without fragmentation, so the cache must behave exactly like a reference LRU."""

    NUM_SLOTS, NBYTES = 6, 1024

    def __init__(self) -> None:
        super().__init__()
        self.name = f"mmenc-test-{uuid.uuid4().hex[:12]}"
        self.cache = ShmEmbeddingCache(self.name, self.NUM_SLOTS * block_bytes(self.NBYTES))
        self.model: OrderedDict[str, torch.Tensor] = OrderedDict()

    @rule(k=st.integers(0, 9), fill=st.integers(-100, 100), dtype=st.sampled_from(["f32", "bf16", "i64"]))
    def put(self, k: int, fill: int, dtype: str) -> None:
        shape, dt = {"f32": ((16, 16), torch.float32), "bf16": ((512,), torch.bfloat16),
                     "i64": ((2, 4, 16), torch.int64)}[dtype]
        t = torch.full(shape, fill, dtype=dt)
        assert self.cache.put(f"k{k}", t)
        self.model.pop(f"k{k}", None)
        while len(self.model) >= self.NUM_SLOTS:
            self.model.popitem(last=False)
        self.model[f"k{k}"] = t

    @rule(k=st.integers(0, 9))
    def get(self, k: int) -> None:
        got, want = self.cache.get(f"k{k}"), self.model.get(f"k{k}")
        assert (got is None) == (want is None)
        if want is not None:
            assert got is not None and got.dtype == want.dtype and torch.equal(got, want)
            self.model.move_to_end(f"k{k}")

    @rule(k=st.integers(0, 9))
    def contains(self, k: int) -> None:
        assert self.cache.contains(f"k{k}") == (f"k{k}" in self.model)

    @invariant()
    def accounting(self) -> None:
        s = self.cache.stats()
        assert s["entries"] == len(self.model) and s["bytes_used"] == len(self.model) * block_bytes(self.NBYTES)

    def teardown(self) -> None:
        self.cache.close()
        self.cache.unlink()


class MixedSizes(RuleBasedStateMachine):
    """Any sizes: a get returns nothing or exactly the last tensor put under that key; the arena stays sound."""

    CAPACITY = 96 * KB

    def __init__(self) -> None:
        super().__init__()
        self.name = f"mmenc-test-{uuid.uuid4().hex[:12]}"
        self.cache = ShmEmbeddingCache(self.name, self.CAPACITY)
        self.last: dict[str, torch.Tensor] = {}

    @rule(k=st.integers(0, 15), numel=st.sampled_from([0, 1, 17, 250, 1000, 4000, 9000, 20000, 30000]),
          fill=st.integers(0, 1000))
    def put(self, k: int, numel: int, fill: int) -> None:
        t = torch.full((numel,), fill, dtype=torch.float32)
        fits = block_bytes(4 * numel) <= self.CAPACITY
        assert self.cache.put(f"k{k}", t) == fits
        if fits:
            self.last[f"k{k}"] = t
            assert torch.equal(self.cache.get(f"k{k}"), t)  # type: ignore[arg-type]

    @rule(k=st.integers(0, 15))
    def get(self, k: int) -> None:
        got = self.cache.get(f"k{k}")
        assert got is None or torch.equal(got, self.last[f"k{k}"])
        assert (got is not None) == self.cache.contains(f"k{k}")

    @rule(roll=st.integers(0, 19))
    def clear(self, roll: int) -> None:
        if roll == 0:
            self.cache.clear()

    @invariant()
    def sound(self) -> None:
        check_arena(self.cache)

    def teardown(self) -> None:
        self.cache.close()
        self.cache.unlink()


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestUniformSizeLRU = UniformSizeLRU.TestCase
TestUniformSizeLRU.settings = _machine_settings
TestMixedSizes = MixedSizes.TestCase
TestMixedSizes.settings = _machine_settings


# ----------------------------------------------------------------------------------------------- processes
def _attach_and_check(name: str, other: str) -> None:
    """Spawned child: attach without creating, read the parent's entry, write one back, create `other`."""
    cache = ShmEmbeddingCache(name, 0, create=False)
    got = cache.get("from-parent")
    ok = got is not None and torch.equal(got, torch.arange(10, dtype=torch.int64))
    cache.put("from-child", torch.full((3, 3), 7, dtype=torch.bfloat16))
    cache.close()
    with ShmEmbeddingCache(other, 64 * KB) as created:
        created.put("k", torch.ones(5))
    os._exit(0 if ok else 3)


def test_arena_outlives_its_processes(name: str) -> None:
    other = name + "-b"
    with ShmEmbeddingCache(name, 64 * KB) as cache:
        cache.put("from-parent", torch.arange(10, dtype=torch.int64))
    child = mp.get_context("spawn").Process(target=_attach_and_check, args=(name, other))
    child.start()
    child.join(60)
    try:
        assert child.exitcode == 0
        with ShmEmbeddingCache(other, 0, create=False) as created:  # its creator has exited
            assert torch.equal(created.get("k"), torch.ones(5))  # type: ignore[arg-type]
            created.unlink()
        assert not ShmEmbeddingCache.exists(other)
        with ShmEmbeddingCache(name, 1 << 20) as cache:  # another capacity: attach as it is
            assert cache.stats()["capacity_bytes"] == 64 * KB
            assert torch.equal(cache.get("from-child"), torch.full((3, 3), 7, dtype=torch.bfloat16))  # type: ignore
            assert ShmEmbeddingCache.exists(name)
            cache.unlink()
        assert not ShmEmbeddingCache.exists(name)
        with pytest.raises(FileNotFoundError):
            ShmEmbeddingCache(name, 0, create=False)
    finally:
        if os.path.exists(f"/dev/shm/{other}"):
            os.unlink(f"/dev/shm/{other}")


class _DieAtStore:
    """Stands in for `Arena.w`: SIGKILLs the process just before its `n`-th word store (counts stores without)."""

    def __init__(self, w: memoryview, n: int, kill: bool = True) -> None:
        self.w, self.n, self.kill = w, n, kill

    def __getitem__(self, i: int) -> int:
        return self.w[i]

    def __setitem__(self, i: int, value: int) -> None:
        if self.n == 0 and self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        self.n -= 1
        self.w[i] = value


CRASH_OPS = {"put-evicting": ("put", "victim", 3000), "put-replacing": ("put", "k5", 2000), "get": ("get", "k3", 0)}


def _run_op(cache: ShmEmbeddingCache, op: str, key: str, numel: int) -> None:
    if op == "put":
        cache.put(key, torch.full((numel,), 5.0))
    else:
        cache.get(key)


def _die_at_store(name: str, n: int, op: str, key: str, numel: int) -> None:
    """Forked child: run one operation on the arena and die just before its n-th store into it."""
    cache = ShmEmbeddingCache(name, 0, create=False)
    arena = cache._live()
    arena.w = _DieAtStore(arena.w, n)  # type: ignore[assignment]
    _run_op(cache, op, key, numel)
    os._exit(0)


def _full_arena(name: str) -> ShmEmbeddingCache:
    cache = ShmEmbeddingCache(name, 20 * block_bytes(4000), lock_timeout_s=5.0)
    for i in range(20):
        assert cache.put(f"k{i}", torch.full((1000,), float(i)))
    return cache


@pytest.mark.parametrize("case", sorted(CRASH_OPS))
def test_killed_at_every_store_of_an_operation(name: str, forkserver: mp.context.ForkServerContext,
                                               case: str) -> None:
    """SIGKILL lands between two word stores; try every such point of one put / get. The next lock holder must
    repair the arena: survivors intact, the half-done entry absent or complete, nothing lost wholesale."""
    op, key, numel = CRASH_OPS[case]
    with _full_arena(name) as cache:  # count the stores of the operation on an identical arena
        arena = cache._live()
        arena.w = counter = _DieAtStore(arena.w, 0, kill=False)  # type: ignore[assignment]
        _run_op(cache, op, key, numel)
        num_stores = -counter.n
        arena.w = counter.w
        cache.unlink()
    assert num_stores > 5
    for n in range(num_stores):
        with _full_arena(name) as cache:
            child = forkserver.Process(target=_die_at_store, args=(name, n, op, key, numel))
            child.start()
            child.join(30)
            assert child.exitcode == -signal.SIGKILL, f"store {n}: exit code {child.exitcode}"
            for i in range(20):
                got = cache.get(f"k{i}")
                assert got is None or torch.equal(got, torch.full((1000,), float(i))) or (
                    op == "put" and f"k{i}" == key), f"store {n}: k{i}"
            if op == "put":  # the new value, or (a replace cut short) the old one, or nothing
                got = cache.get(key)
                assert got is None or torch.equal(got, torch.full((numel,), 5.0)) or (
                    key == "k5" and torch.equal(got, torch.full((1000,), 5.0))), f"store {n}: {key}"
            check_arena(cache)
            s = cache.stats()
            assert s["recoveries"] <= 1 and s["entries"] >= 16, f"store {n}: {s}"
            assert cache.put("after", torch.ones(2000)) and torch.equal(cache.get("after"), torch.ones(2000))
            cache.unlink()


def test_a_forked_child_does_not_share_the_parents_lock(name: str) -> None:
    with ShmEmbeddingCache(name, 64 * KB, lock_timeout_s=0.2) as cache:
        assert cache._lock()
        try:
            child = mp.get_context("fork").Process(target=lambda: os._exit(3 if cache.put("k", torch.ones(1)) else 0))
            child.start()
            child.join(30)
            assert child.exitcode == 0  # the put timed out on the parent's lock instead of barging in
        finally:
            cache._unlock()
        assert cache.put("k", torch.ones(1)) and cache.stats()["put_failures"] == 0  # counted in the child's copy


# ----------------------------------------------------------------------------------------------- stress
STRESS_KEYS = 48


def stress_value(kid: int, ver: int) -> torch.Tensor:
    """A tensor that identifies its key and version: [kid, ver, then a pattern of both]; dtype and size vary."""
    n = 64 + (kid * 977 % 61) * 1024 + ver % 5 * 128
    dtype = (torch.int32, torch.float32, torch.int64)[kid % 3]
    body = (torch.arange(n, dtype=torch.int64) * 31 + kid * 1009 + ver * 7919) % (1 << 22)
    body[0], body[1] = kid, ver
    return body.to(dtype)


def is_stress_value(got: torch.Tensor, kid: int) -> bool:
    return got.dim() == 1 and got.numel() >= 2 and int(got[0]) == kid and torch.equal(
        got, stress_value(kid, int(got[1])))


def _stress_worker(name: str, seed: int, put_ratio: float, deadline: float,
                   report: mp.connection.Connection | None) -> None:
    """Random gets (verified) and puts on a shared key space until `deadline` (time.monotonic(), which is
    machine-wide); exit code 3 on a wrong value."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    cache = ShmEmbeddingCache(name, 0, create=False, lock_timeout_s=2.0)
    hits = misses = puts = 0
    while time.monotonic() < deadline:
        kid = rng.randrange(STRESS_KEYS)
        key = hashlib.sha256(str(kid).encode()).hexdigest()  # 64 characters, the longest key allowed
        if rng.random() < put_ratio:
            puts += cache.put(key, stress_value(kid, rng.randrange(10**6)))
            continue
        got = cache.get(key)
        if got is None:
            misses += 1
        elif is_stress_value(got, kid):
            hits += 1
        else:
            os._exit(3)
    if report is not None:
        report.send((hits, misses, puts))
    cache.close()


def test_stress_with_writers_killed_mid_run(name: str, forkserver: mp.context.ForkServerContext) -> None:
    seconds, rng = 5.0, random.Random(0)
    cache = ShmEmbeddingCache(name, 3 << 20, lock_timeout_s=5.0)
    deadline = time.monotonic() + seconds
    readers = []
    for seed in range(2):  # mostly read; never killed; they report what they saw
        recv, send = forkserver.Pipe(duplex=False)
        proc = forkserver.Process(target=_stress_worker, args=(name, seed, 0.2, deadline, send))
        proc.start()
        readers.append((proc, recv))

    def start_writer() -> mp.process.BaseProcess:
        proc = forkserver.Process(target=_stress_worker, args=(name, rng.randrange(1 << 30), 0.8, deadline, None))
        proc.start()
        return proc

    writers, kills = [start_writer(), start_writer()], 0
    while time.monotonic() < deadline - 0.3:
        time.sleep(rng.uniform(0.02, 0.12))
        i = rng.randrange(len(writers))
        os.kill(writers[i].pid, signal.SIGKILL)  # type: ignore[arg-type]
        writers[i].join(10)
        assert writers[i].exitcode == -signal.SIGKILL, "a writer saw a wrong value"
        kills += 1
        writers[i] = start_writer()
    for proc in writers:
        proc.join(30)
        assert proc.exitcode == 0
    seen = [0, 0, 0]
    for proc, recv in readers:
        proc.join(30)
        assert proc.exitcode == 0, "a reader saw a wrong value or hung"
        seen = [a + b for a, b in zip(seen, recv.recv(), strict=True)]

    ok: list[bool] = []  # no deadlock: a put and a get finish well within the timeout
    probe = threading.Thread(target=lambda: ok.append(cache.put("probe", torch.ones(9))
                                                      and torch.equal(cache.get("probe"), torch.ones(9))))
    probe.start()
    probe.join(10)
    assert ok == [True]
    check_arena(cache)
    s = cache.stats()
    print(f"stress: {kills} kills, readers saw {seen[0]} verified hits / {seen[1]} misses, stats {s}")
    assert kills >= 20 and seen[0] > 100
    assert s["hits"] >= seen[0] and s["puts"] >= seen[2] and s["bytes_used"] <= s["capacity_bytes"]
    cache.close()
