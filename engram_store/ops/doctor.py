"""``engram-store doctor``: every check a deploy needs, each a PASS / WARN / FAIL line with its fix.

The config is read exactly as ``serve`` reads it (:func:`engram_store.daemon.config.load_config`:
``--config`` file, ``ENGRAM_STORE_*`` environment, defaults), the placement is planned as the
store plans it (:func:`engram_store.storage.placement.plan_store`), memory limits come from the
daemon's own preflight helper (:func:`engram_store.daemon.host.memory_limits`) and the engine
verdict from :func:`engram_store.client.engine_fit.engine_fit`, so doctor cannot disagree with
them. Nothing on the host is changed. Exit status: 0 when nothing FAILs (deploy), 1 otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from ..client.engine_fit import engine_fit
from ..client.status import describe_model, format_bytes, model_words
from ..daemon.config import DaemonConfig, load_config
from ..daemon.host import memory_limits, probe_socket
from ..errors import EngramStoreError
from ..format.manifest import Manifest
from ..native.pagesizes import MAX_PADDING_SHARE, PageSizes, format_page
from ..storage.placement import CACHED, RESIDENT, cache_slots, parse_placement, plan_store, slot_bytes
from ..storage.resident import arena_backings, resident_layout
from . import probes
from .access import User, blocked_at, describe

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
FIXED_OVERHEAD_BYTES = 32 << 20  # staging buffers and the like, beside the per-row maps and page checksums


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, WARN, FAIL or SKIP (does not apply here)
    found: str  # what was found
    fix: str = ""  # what to do about a WARN or FAIL

    def to_dict(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "found": self.found, "fix": self.fix}


@dataclass
class Plan:
    """What ``config`` gives on its table set: placement and the DRAM it takes."""

    config: DaemonConfig
    manifest: Manifest
    placement: dict[int, str]
    arena_bytes: int = 0
    cache_bytes: int = 0
    overhead_bytes: int = 0
    table_bytes: int = 0
    layer_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def dram_bytes(self) -> int:
        return self.arena_bytes + self.cache_bytes + self.overhead_bytes

    def layers(self, where: str) -> list[int]:
        return sorted(layer for layer, w in self.placement.items() if w == where)


def gib(n: float) -> str:
    return format_bytes(int(n))


def make_plan(config: DaemonConfig, manifest: Manifest) -> Plan:
    """The placement ``config`` gives ``manifest`` and the DRAM it takes; ConfigError when it does not fit."""
    placement = plan_store(manifest, dram_bytes=config.dram_bytes, mode=config.store_mode,
                           policy=config.cache_policy, placement=parse_placement(config.placement))
    rows = {e.layer: e.rows for e in manifest.layers}
    resident = [(layer, rows[layer]) for layer in sorted(rows) if placement[layer] == RESIDENT]
    arena = resident_layout(resident, manifest.spec.row_format).size if resident else 0
    per_slot = slot_bytes(manifest.spec.row_bytes, config.cache_policy)
    slots = cache_slots(placement, rows, config.dram_bytes, arena, per_slot)
    cached_rows = sum(n for layer, n in rows.items() if placement[layer] == CACHED)
    pages = sum(e.layout.pages for e in manifest.layers)
    overhead = 4 * pages + 4 * cached_rows + FIXED_OVERHEAD_BYTES  # page crc32c, row->slot maps, buffers
    return Plan(config, manifest, placement, arena, slots * per_slot, overhead, sum(e.file_bytes for e in manifest.layers),
                {e.layer: e.file_bytes for e in manifest.layers})


# --- the checks ---------------------------------------------------------------------------
def check_placement(plan: Plan) -> list[Check]:
    resident, cached = plan.layers(RESIDENT), plan.layers(CACHED)
    parts = [f"layers {resident} resident (arena {gib(plan.arena_bytes)})"] if resident else []
    if cached:
        rows = sum(e.rows for e in plan.manifest.layers if e.layer in cached)
        share = plan.cache_bytes / slot_bytes(plan.manifest.spec.row_bytes, plan.config.cache_policy) / max(rows, 1)
        parts.append(f"layers {cached} cached (a cache of {gib(plan.cache_bytes)}, {share:.1%} of their rows)")
    out = [Check("placement", PASS, f"dram_bytes {gib(plan.config.dram_bytes)} for {gib(plan.table_bytes)} of "
                 f"tables: " + "; ".join(parts))]
    fit = engine_fit({"placement": {str(k): v for k, v in plan.placement.items()}})
    if fit.problems:
        out.append(Check("engines", FAIL, fit.summary(), "see the problems named"))
    elif cached:
        whole = resident_layout([(e.layer, e.rows) for e in plan.manifest.layers], plan.manifest.spec.row_format).size
        asked = ", ".join(f'{layer} = "resident"' for layer in cached)
        out.append(Check("engines", WARN, f"vLLM / SGLang {fit.summary()}: each cached layer costs a lookup through "
                         "the daemon per step, misses read from NVMe",
                         f"to read every layer in place, give the cached layers DRAM: dram_bytes of at least "
                         f"{gib(whole)} (placement = {{{asked}}})"))
    else:
        out.append(Check("engines", PASS, f"vLLM / SGLang {fit.summary()}"))
    return out


def check_memory(plan: Plan, limits: list | None = None, running: int | None = None) -> Check:
    limits = memory_limits() if limits is None else limits
    need = plan.dram_bytes
    if not limits:
        return Check("memory", WARN, f"the daemon needs about {gib(need)}; no MemAvailable or cgroup limit readable",
                     "check the host's free memory by hand")
    tight = min(limits, key=lambda m: m.available)
    found = (f"the daemon needs about {gib(need)} (arena {gib(plan.arena_bytes)}, cache {gib(plan.cache_bytes)}, "
             f"maps and checksums {gib(plan.overhead_bytes)}); the tightest bound: {tight.name} allows "
             f"{gib(tight.available)} ({tight.detail})")
    if running:
        found += f"; a daemon already runs here (pid {running}): its memory is not counted as available"
    if tight.available < need:
        return Check("memory", FAIL, found, f"free memory or raise the limit ({tight.where}), or lower dram_bytes")
    if plan.arena_bytes and tight.available < need + plan.arena_bytes and not running:
        return Check("memory", WARN, found, "a daemon restart holds two arenas while engines still map the old one: "
                     f"keep {gib(need + plan.arena_bytes)} free for restarts, or stop the engines first")
    return Check("memory", PASS, found)


def check_huge_pages(plan: Plan, sizes: PageSizes | None = None) -> Check:
    """What backs the arena on this kernel's page sizes, as :meth:`ResidentArena.build` decides it."""
    sizes = probes.page_sizes() if sizes is None else sizes
    if not plan.arena_bytes:
        return Check("huge pages", SKIP, "no resident layer: no arena to back")
    rows = {e.layer: e.rows for e in plan.manifest.layers}
    resident = [(layer, rows[layer]) for layer in plan.layers(RESIDENT)]
    fmt = plan.manifest.spec.row_format
    pools = ", ".join(f"{format_page(p.page_bytes)} {p.available} free of {p.total}"
                      + (" (default)" if p.page_bytes == sizes.default_huge_bytes else "") for p in sizes.pools)
    found = (f"arena {gib(plan.arena_bytes)}; {format_page(sizes.page_bytes)} pages; hugetlb {pools or 'none'}; "
             f"THP {format_page(sizes.thp_bytes) if sizes.thp_bytes else 'none'} enabled [{sizes.thp_enabled or '?'}], "
             f"shmem [{sizes.thp_shmem or '?'}]")
    if not plan.config.huge_pages:
        return Check("huge pages", WARN, found + "; config huge_pages = false",
                     "set huge_pages = true: GPU reads of the arena over small pages are several times slower")
    best = arena_backings(resident, fmt, huge=True, sizes=sizes)[0]
    if best.kind == "hugetlb":
        return Check("huge pages", PASS, found + f": the arena takes {best.nbytes // best.page_bytes} {best.describe()}")
    if best.kind == "thp":
        return Check("huge pages", PASS, found + f": the arena asks for {best.describe()} (madvise)")
    return Check("huge pages", WARN, found + f": the arena would sit on {format_page(sizes.page_bytes)} pages (a TLB "
                 "miss per row read)", _reserve_fix(resident, fmt, sizes))


def _reserve_fix(resident: list[tuple[int, int]], fmt, sizes: PageSizes) -> str:
    """How to give the arena huge pages: the largest size the arena would take (padding within
    pagesizes.MAX_PADDING_SHARE), its pool raised by the pages it lacks; else THP."""
    thp = f"`echo advise > {probes.THP_DIR}/shmem_enabled` (transparent huge pages)"
    base = resident_layout(resident, fmt, page_bytes=sizes.page_bytes).size
    fits = [p for p in sizes.pools
            if resident_layout(resident, fmt, page_bytes=p.page_bytes).size - base <= base * MAX_PADDING_SHARE]
    if not fits:
        return thp
    pool = max(fits, key=lambda p: p.page_bytes)
    need = resident_layout(resident, fmt, page_bytes=pool.page_bytes).size // pool.page_bytes
    target = pool.total + max(0, need - pool.available)
    size, boot = format_page(pool.page_bytes), format_page(pool.page_bytes).replace(" ", "").replace("iB", "")
    how = (f"`sysctl -w vm.nr_hugepages={target}` (the default size; persist in /etc/sysctl.d/)"
           if pool.page_bytes == sizes.default_huge_bytes else
           f"`echo {target} > /sys/kernel/mm/hugepages/hugepages-{pool.page_bytes >> 10}kB/nr_hugepages`")
    return (f"the arena takes {need} pages of {size}: raise that pool to {target} before the daemon starts, {how} "
            f"or hugepagesz={boot} hugepages={target} on the kernel command line; or {thp}")


def check_platform(facts: probes.Platform | None = None) -> Check:
    """Architecture, page sizes, the crc32c implementation and the native modules this install runs."""
    facts = probes.platform_facts() if facts is None else facts
    sizes = facts.sizes
    found = (f"{facts.machine}, kernel {facts.kernel}, {format_page(sizes.page_bytes)} pages, huge page sizes "
             f"{', '.join(format_page(p.page_bytes) for p in sizes.pools) or 'none'} (default "
             f"{format_page(sizes.default_huge_bytes) if sizes.default_huge_bytes else 'none'}), THP "
             f"{format_page(sizes.thp_bytes) if sizes.thp_bytes else 'none'}; page checks: crc32c {facts.crc32c}")
    if facts.missing_native:
        return Check("platform", WARN, found + f"; native modules not built: {', '.join(facts.missing_native)}",
                     "install the release wheel for this architecture (x86_64 or aarch64: `pip install engram-store`), "
                     "or a C compiler and the Python headers before installing from source; without _fetch engines "
                     "refuse cached layers")
    if facts.crc32c == "software" and facts.cpu_crc32c:
        return Check("platform", WARN, found + "; the CPU has a crc32c instruction the build does not use",
                     "install a wheel built for this architecture (the instruction is probed at run time)")
    return Check("platform", PASS, found)


def check_disk(plan: Plan) -> Check:
    free, where = probes.free_bytes(os.path.dirname(os.path.abspath(plan.config.tables)) or ".")
    found = f"{gib(free)} free on {where}; the table set is {gib(plan.table_bytes)}"
    if free < plan.table_bytes:
        return Check("disk", WARN, found, "a re-import or re-synth writes the new set beside the old one before the "
                     f"swap: free {gib(plan.table_bytes - free)} more there, or write it elsewhere")
    return Check("disk", PASS, found)


def check_reader(plan: Plan) -> Check:
    entry = plan.manifest.layers[0]
    path = entry.stripe_paths(plan.config.tables)[0] if entry.stripes else os.path.join(plan.config.tables, entry.file)
    try:
        rp = probes.read_path(path)
    except OSError as exc:
        return Check("NVMe reads", FAIL, f"cannot open {path}: {exc.strerror or exc}",
                     "the daemon must read its table files: check the path and its mode")
    uses = "cold rows of cached layers" if plan.layers(CACHED) else "the resident fill only"
    found = f"{path}: reader {rp.reader}, O_DIRECT {'yes' if rp.direct else 'refused'} (used by {uses})"
    if not rp.direct:
        return Check("NVMe reads", WARN, found, "the file system refuses O_DIRECT, so reads go through the page cache "
                     "(a second copy in DRAM): put the tables on ext4 or xfs on the NVMe device")
    if rp.reader != "uring":
        return Check("NVMe reads", WARN, found + f"; io_uring: {rp.why_not_uring}",
                     "io_uring costs the least CPU per page: allow it (kernel.io_uring_disabled = 0, a seccomp "
                     "profile that permits io_uring_setup) where the daemon runs")
    return Check("NVMe reads", PASS, found)


def check_socket(config: DaemonConfig, user: User | None) -> Check:
    if not config.socket:
        return Check("socket", WARN, "socket = \"\": no Unix socket", "engines need the Unix socket: set socket")
    import grp

    directory = os.path.dirname(os.path.abspath(config.socket))
    group = config.socket_group or "(the daemon's primary group)"
    found = f"{config.socket}, mode {config.socket_mode:04o}, group {group}"
    gid = None
    if config.socket_group:
        try:
            gid = grp.getgrnam(config.socket_group).gr_gid
        except KeyError:
            return Check("socket", FAIL, found + f"; no group {config.socket_group!r} on this host",
                         f"create it (`groupadd {config.socket_group}`) and add the daemon's and the engines' users")
    if user is None:
        return Check("socket", PASS, found + " (an engine's access not checked: give --engine-user)")
    fix = (f"add {user.name} to the socket's group (`usermod -aG {config.socket_group or 'GROUP'} {user.name}`; "
           "Kubernetes: securityContext.supplementalGroups) and make every directory above the socket searchable by it")
    who = f"{user.name} (groups {user.groups_text()})"
    if os.path.exists(config.socket):
        why = blocked_at(user, config.socket, os.R_OK | os.W_OK)
        return Check("socket", FAIL, found + f"; {who} cannot connect: {why}", fix) if why else \
            Check("socket", PASS, found + f"; now {describe(config.socket)}: {user.name} can connect")
    why = blocked_at(user, directory, os.X_OK) if os.path.exists(directory) else None
    if why:
        return Check("socket", FAIL, found + f"; {who} cannot reach it: {why}", fix)
    if user.uid == 0 or config.socket_mode & 0o006 == 0o006 or (gid is not None and gid in user.gids):
        return Check("socket", PASS, found + f"; {user.name} will be able to connect")
    if gid is not None:
        return Check("socket", FAIL, found + f"; {who} is not in group {config.socket_group}", fix)
    return Check("socket", WARN, found + f"; socket_group is not set, so whether {who} may connect depends on the "
                 "daemon's user", f"set socket_group to a group of the daemon and of {user.name}")


def check_table_files(plan: Plan, user: User | None) -> Check:
    if user is None:
        return Check("table files", SKIP, "an engine's read access not checked: give --engine-user")
    blocked = []
    for e in plan.manifest.layers:
        paths = e.stripe_paths(plan.config.tables) if e.stripes else [os.path.join(plan.config.tables, e.file)]
        for path in list(paths) + [os.path.join(plan.config.tables, e.crc_file)]:
            why = blocked_at(user, path, os.R_OK)
            if why:
                blocked.append(why)
    if blocked:
        return Check("table files", WARN, f"{user.name} cannot read {len(blocked)} table file(s): {blocked[0]}",
                     "engines reading cold rows by plan read the table files themselves (else the daemon reads "
                     "for them): publish the set for their group (`engram-store synth/import --group GROUP`, "
                     "mode 0640, directory 0750)")
    return Check("table files", PASS, f"{user.name} can read every table file (plan mode reads them directly)")


def check_memlock(plan: Plan, limit: int | None | str = "probe") -> Check:
    limit = probes.memlock_limit() if limit == "probe" else limit
    if not plan.arena_bytes:
        return Check("memlock", SKIP, "no resident arena to register with cudaHostRegister")
    found = f"RLIMIT_MEMLOCK of this shell: {'unlimited' if limit is None else gib(limit)}; arena {gib(plan.arena_bytes)}"
    if limit is not None and limit < plan.arena_bytes:
        return Check("memlock", WARN, found + " (engines started the same way could not pin the arena)",
                     "give the engines `ulimit -l unlimited` (systemd LimitMEMLOCK=infinity; containers: "
                     "--ulimit memlock=-1)")
    return Check("memlock", PASS, found)


def check_gpu(gpu: probes.Gpu | None = None) -> Check:
    gpu = probes.gpu() if gpu is None else gpu
    if not gpu.torch and not gpu.kvikio:
        return Check("CUDA", SKIP, "neither torch nor kvikio is installed here")
    if gpu.error and not gpu.cuda:
        return Check("CUDA", WARN, gpu.error, "check the NVIDIA driver and the CUDA build of torch")
    found = (f"{len(gpu.devices)} device(s): {', '.join(gpu.devices)}" if gpu.cuda else "torch without a CUDA device")
    found += f"; kvikio {gpu.kvikio_mode or 'mode unknown'}" if gpu.kvikio else "; kvikio not installed"
    if gpu.kvikio and gpu.kvikio_mode == "compat":
        return Check("CUDA", WARN, found, "kvikio in compat mode reads through the CPU: install cuFile (GPUDirect "
                     "Storage) for direct NVMe-to-GPU reads of the resident fill")
    return Check("CUDA", PASS, found)


def check_gpu_runtime(facts: probes.GpuRuntimeFacts | None = None, plan: Plan | None = None) -> Check:
    """GPU vendor and runtime (CUDA or ROCm) with their versions, and whether the GPU can register the
    read-only arena (the engines' resident layers) as it is."""
    facts = probes.gpu_runtime() if facts is None else facts
    name = "GPU runtime"
    if not facts.torch_version:
        return Check(name, SKIP, facts.error or "torch is not installed here (run doctor where the engines run)")
    if not facts.runtime:
        return Check(name, SKIP, f"torch {facts.torch_version} is a CPU build: no GPU runtime")
    found = (f"{facts.vendor}, {facts.runtime} {facts.runtime_version}" + (f" (driver {facts.driver_version})"
             if facts.driver_version else "") + f", torch {facts.torch_version}")
    if facts.error or not facts.devices:
        return Check(name, WARN, found + f"; {facts.error or 'no device visible'}",
                     f"check the {facts.vendor} driver and the devices visible to this process")
    found += f"; {len(facts.devices)} device(s): {', '.join(sorted(set(facts.devices)))}"
    if facts.runtime == "ROCm":
        return Check(name, PASS, found + "; host memory registered Portable | Mapped (no read-only flag on AMD); "
                     "no GPUDirect Storage on ROCm: table reads are O_DIRECT (the daemon's, and the fetch jobs' into "
                     "pinned staging)")
    found += f"; read-only host registration: {facts.read_only or 'unknown'}"
    if facts.read_only_supported is False and plan is not None and plan.arena_bytes:
        return Check(name, WARN, found, "the arena is mapped read-only: engines register it without the flag, which "
                     "works only where the GPU uses the host's page tables (...UsesHostPageTables = 1); elsewhere "
                     "they refuse the resident layers " + str(plan.layers(RESIDENT)) + " (cached layers are served): "
                     "place them cached, or use a driver and GPU that support read-only registration")
    return Check(name, PASS, found)


def run(config_file: str | None = None, engine_user: str | None = None,
        environ: Mapping[str, str] | None = None) -> list[Check]:
    """Every check, in order; a config or table set that cannot be read stops the checks that need it."""
    checks: list[Check] = []
    try:
        config = load_config({}, config_file=config_file, environ=environ)
    except EngramStoreError as exc:
        return [Check("config", FAIL, str(exc), "fix the key named (deploy/engram-store.toml documents each)")]
    source = config_file or (environ or os.environ).get("ENGRAM_STORE_CONFIG") or "defaults and environment"
    checks.append(Check("config", PASS, f"{source}: tables {config.tables or '(none)'}, dram_bytes "
                        f"{gib(config.dram_bytes)}, store_mode {config.store_mode}"))
    try:
        user = User.lookup(engine_user) if engine_user else None
    except EngramStoreError as exc:
        checks.append(Check("engine user", FAIL, str(exc), "give an existing user (the engine's)"))
        user = None
    plan = None
    if not config.tables:
        checks.append(Check("tables", FAIL, "config key 'tables' is empty", "set tables to a table-set directory "
                            "(engram-store synth or import writes one)"))
    else:
        try:
            manifest = Manifest.load(config.tables)
        except (EngramStoreError, OSError) as exc:
            checks.append(Check("tables", FAIL, f"{config.tables}: {exc}", "point tables at a table set "
                                "(engram-store synth or import writes one)"))
        else:
            model = model_words(describe_model(manifest.spec.to_dict()))
            checks.append(Check("tables", PASS, f"{config.tables}: {model}; layers "
                                f"{[e.layer for e in manifest.layers]}, "
                                f"{gib(sum(e.file_bytes for e in manifest.layers))}"))
            try:
                plan = make_plan(config, manifest)
            except EngramStoreError as exc:
                checks.append(Check("placement", FAIL, str(exc), "raise dram_bytes, or use store_mode \"auto\" or "
                                    "\"cached\" (engram-store info DIR gives each layer's size)"))
    running = None
    if config.socket:
        try:
            running = probe_socket(config.socket)
        except OSError as exc:
            checks.append(Check("socket", FAIL, str(exc), "remove what is at the socket path or choose another"))
    if plan is not None:
        checks += check_placement(plan)
        checks.append(check_memory(plan, running=running))
        checks.append(check_huge_pages(plan))
        checks.append(check_disk(plan))
        checks.append(check_reader(plan))
        checks.append(check_table_files(plan, user))
        checks.append(check_memlock(plan))
    checks.append(check_socket(config, user))
    checks.append(check_platform())
    if running is not None:
        checks.append(Check("daemon", PASS, f"a daemon already serves {config.socket} (pid {running or '?'}): "
                            "`engram-store status unix://" + os.path.abspath(config.socket) + "` shows it"))
    checks.append(check_gpu())
    checks.append(check_gpu_runtime(plan=plan))
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status:<5} {c.name}: {c.found}")
        if c.fix and c.status in (WARN, FAIL):
            lines.append(f"{'':<6}fix: {c.fix}")
    fails, warns = sum(c.status == FAIL for c in checks), sum(c.status == WARN for c in checks)
    lines.append("deploy: " + (f"NO, {fails} check(s) failed" if fails else
                               f"yes ({warns} warning(s))" if warns else "yes"))
    return "\n".join(lines)
