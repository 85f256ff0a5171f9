"""The GPU's clocks and power beside a measurement: a step's time means little without the clock it ran at.

One idea: a GPU under a power limit lowers its SM clock when sustained work draws more than the limit (an
H200 at 700 W: the 8B decode step at 256 sequences ran at 1,380-1,965 MHz of its 1,980 with "SW power cap"
set, docs/benchmarks.md 2026-12-03). Then a faster schedule of the same work mostly draws more power and the
clock gives the time back; only less energy per step (less work, fewer bytes moved) is faster. So a
benchmark window is sampled by `nvidia-smi` (every `interval_ms`, in a process beside it: no Python thread
beside the engine's loop) and reports its SM clock, power draw and the share of samples with a power or
thermal slowdown reason active; and, where NVML's Python binding is installed (nvidia-ml-py, the cuda
extras), the energy the GPU used over the window, from its own counter (nvmlDeviceGetTotalEnergyConsumption).
That counter advances in steps (every ~100 ms on an H200: ~70 J at 700 W), so the window is counted from one
step of it to the first step after the work, and a window shorter than MIN_ENERGY_WINDOW_S reports no energy:
two reads around 20 decode steps (170 ms) once said 326 W where the GPU drew 680.

Invariant: sampling never changes the device's settings (nvidia-smi and NVML only query); with no
nvidia-smi, or no sample in the window, the result is None and the benchmark's own numbers are unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

# The power is the instant draw: `power.draw` is a one-second average on Ampere and later (it read 505 W over 1.5 s
# of matmuls at 682 W, and 99 W over 0.2 s of them, on an H200), longer than the windows sampled here. Drivers
# without `power.draw.instant` (it came with the 530 series) get the average (FALLBACK_QUERY).
QUERY = "clocks.sm,power.draw.instant,clocks_event_reasons.active"
FALLBACK_QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
# NVML's clock event reasons that mean a slowdown below the application clock: SW power cap, HW slowdown,
# SW thermal slowdown, HW thermal slowdown, HW power brake (nvml.h, nvmlClocksEventReason*).
SLOWDOWN_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
POWER_CAP = 0x4
MIN_ENERGY_WINDOW_S = 1.0  # shorter windows get no energy: NVML's counter steps every ~0.1 s
COUNTER_STEP_WAIT_S = 0.5  # at most this long for the energy counter's next step


@dataclass
class Telemetry:
    samples: int
    sm_clock_mhz: float  # mean over the samples
    sm_clock_min_mhz: float
    power_w: float  # mean draw over the samples (each the instant draw, or a 1-s average: `query`)
    power_max_w: float
    slowed_share: float  # samples with a slowdown reason (SLOWDOWN_REASONS) active
    power_capped_share: float  # samples with the software power cap active
    energy_j: float | None = None  # the GPU's energy over the window (NVML's counter; None: no nvidia-ml-py, or
    # a window shorter than MIN_ENERGY_WINDOW_S)
    window_s: float | None = None  # the energy's window: from a step of the counter to its first step after the
    # work (energy_j / window_s: its mean power; it ends at most one counter step after the work)
    query: str = QUERY  # the nvidia-smi fields sampled (FALLBACK_QUERY: this driver has no instant power)


def parse(text: str) -> Telemetry | None:
    """nvidia-smi's `--query-gpu=QUERY --format=csv,noheader,nounits` lines -> Telemetry (None: no sample).
    Lines that are not three fields of numbers (a header, "[N/A]", a line cut by the stop) are skipped."""
    rows = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            rows.append((float(fields[0]), float(fields[1]), int(fields[2], 16)))
        except ValueError:
            continue
    if not rows:
        return None
    clocks, power, reasons = zip(*rows)
    n = len(rows)
    return Telemetry(n, sum(clocks) / n, min(clocks), sum(power) / n, max(power),
                     sum(1 for r in reasons if r & SLOWDOWN_REASONS) / n, sum(1 for r in reasons if r & POWER_CAP) / n)


class GpuSampler:
    """`with GpuSampler(uuid) as s: ...` then `s.result`: the window's Telemetry, or None (no nvidia-smi, a
    CPU run: uuid None, or no sample). uuid: the device's, as torch gives it (the same GPU whatever
    CUDA_VISIBLE_DEVICES numbers it)."""

    def __init__(self, uuid: str | None, interval_ms: int = 20):
        # nvidia-smi's -i and NVML both name a GPU "GPU-<uuid>"; torch gives the bare UUID
        self.uuid = uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}"
        self.interval_ms = interval_ms
        self.result: Telemetry | None = None
        self._proc = self._out = self._energy0 = self._read_energy = None
        self._query = QUERY
        self._t0 = 0.0

    def __enter__(self) -> "GpuSampler":
        exe = shutil.which("nvidia-smi")
        if exe and self.uuid:
            for self._query in (QUERY, FALLBACK_QUERY):
                self._out = tempfile.TemporaryFile(mode="w+")
                self._proc = subprocess.Popen([exe, "-i", self.uuid, f"--query-gpu={self._query}",
                                               "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
                                              stdout=self._out, stderr=subprocess.DEVNULL)
                if self._first_sample() or self._query == FALLBACK_QUERY:
                    break
                self._proc.kill()  # an error (a field this driver does not know): it quits, or is stopped
                self._proc.wait()
                self._out.close()
            self._read_energy = _energy_reader(self.uuid)  # NVML opened once, read at both ends
            self._energy0, self._t0 = _counter_step(self._read_energy)
        return self

    def _first_sample(self, timeout_s: float = 3.0) -> bool:
        """Wait until the first sample is written (NVML's start takes ~0.1 s), so the window is sampled from its start;
        False where nvidia-smi printed no sample but an error, or quit (a field this driver does not know)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._out.flush()
            if os.fstat(self._out.fileno()).st_size > 0:
                self._out.seek(0)
                printed = self._out.read()
                self._out.seek(0, os.SEEK_END)
                if parse(printed) is not None:
                    return True
                if "\n" in printed:  # a whole line that is no sample: an error message
                    return False
            if self._proc.poll() is not None:
                return False
            time.sleep(0.01)
        return self._proc.poll() is None  # still running: its samples come later

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        work = time.perf_counter() - self._t0
        # the counter's next step only where the energy will be reported (no wait after a short window)
        energy, t1 = _counter_step(self._read_energy) if work >= MIN_ENERGY_WINDOW_S else (None, time.perf_counter())
        window = t1 - self._t0
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.seek(0)
        self.result = parse(self._out.read())
        self._out.close()
        if self.result is not None:
            self.result.window_s, self.result.query = window, self._query
            if energy is not None and self._energy0 is not None:
                self.result.energy_j = (energy - self._energy0) / 1e3


def _energy_reader(uuid: str) -> Callable[[], int] | None:
    """() -> GPU `uuid`'s ("GPU-...") energy counter in millijoules since the driver loaded (NVML), or None without
    nvidia-ml-py or where NVML cannot read it."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except pynvml.NVMLError:
        return None
    return lambda: int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))


def _counter_step(read: Callable[[], int] | None) -> tuple[int | None, float]:
    """(the energy counter's value, the time) just after its next step (or after COUNTER_STEP_WAIT_S without
    one; None at once where `read`, an _energy_reader, is None): a window counted between two steps has the
    counter's resolution at neither end."""
    if read is None:
        return None, time.perf_counter()
    first, deadline = read(), time.perf_counter() + COUNTER_STEP_WAIT_S
    while True:
        now, t = read(), time.perf_counter()
        if now != first or t > deadline:
            return now, t
        time.sleep(0.001)


def device_uuid(device) -> str | None:
    """The CUDA device's UUID string (None on the CPU or where torch does not give one)."""
    import torch

    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else None


def sustained(calls, seconds: float, uuid: str | None, settle_s: float = 0.3, sync=lambda: None):
    """Run `calls` (e.g. graph replays, each one unit of work) round and round: `settle_s` first, so the clock
    settles under the power cap, then about `seconds` sampled -> (seconds per call over the sampled window,
    joules per call (None: no energy counter), its Telemetry or None). What a kernel costs inside a long run (the engine's steps), where a short timing
    sees the clock before the cap lowers it. sync: the device's synchronize (the window ends when the work has)."""
    def rounds(until: float) -> int:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < until:
            for call in calls:
                call()
            n += 1
        sync()
        return n

    per_round = settle_s / max(rounds(settle_s), 1)
    reps = max(1, round(seconds / per_round))
    with GpuSampler(uuid) as sampler:
        t0 = time.perf_counter()
        for _ in range(reps):
            for call in calls:
                call()
        sync()
        elapsed = time.perf_counter() - t0
    n = reps * len(calls)
    tele = sampler.result
    return elapsed / n, (tele.energy_j / n if tele and tele.energy_j is not None else None), tele
