"""bench.telemetry: nvidia-smi's samples parsed into a window's clock, power and slowdown shares (no GPU needed)."""

import os
import stat
import sys

import pytest

from pagedref.bench import telemetry

# Lines as `nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader,nounits`
# printed them on an H200 during the 8B step (2026-12-03): 0x4 is the software power cap.
LINES = """1980, 368.88, 0x0000000000000000
1410, 402.81, 0x0000000000000004
1395, 506.63, 0x0000000000000004
1380, 628.41, 0x0000000000000004
"""


def fake_nvidia_smi(tmp_path, monkeypatch, body: str = "printf '1400, 690.0, 0x4\\n'\nexec sleep 30\n"):
    """An `nvidia-smi` on PATH that runs this shell script."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_samples_give_the_window_mean_min_and_capped_share():
    t = telemetry.parse(LINES)
    assert t.samples == 4
    assert t.sm_clock_mhz == pytest.approx((1980 + 1410 + 1395 + 1380) / 4)
    assert t.sm_clock_min_mhz == 1380
    assert t.power_max_w == pytest.approx(628.41)
    assert t.power_capped_share == pytest.approx(0.75), "three of the four samples have the power cap (0x4) set"
    assert t.slowed_share == pytest.approx(0.75)


def test_a_thermal_slowdown_is_a_slowdown_but_not_the_power_cap():
    t = telemetry.parse("1500, 300.0, 0x0000000000000040\n1980, 100.0, 0x0000000000000001\n")  # HW thermal; idle
    assert t.slowed_share == 0.5 and t.power_capped_share == 0.0


def test_lines_that_are_not_samples_are_skipped_and_none_means_no_sample():
    assert telemetry.parse("clocks.sm [MHz], power.draw [W], clocks_event_reasons.active\n[N/A], [N/A], 0x0\n") is None
    assert telemetry.parse("") is None
    assert telemetry.parse("1980, 350.5, 0x0\n19") .samples == 1, "a line cut by the stop is not a sample"


def test_without_a_gpu_the_sampler_reports_nothing():
    with telemetry.GpuSampler(None) as s:
        pass
    assert s.result is None
    assert telemetry.device_uuid("cpu") is None


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_the_sampler_runs_nvidia_smi_on_the_device_and_parses_what_it_printed(tmp_path, monkeypatch):
    args_file = tmp_path / "args"
    printed = LINES.replace(chr(10), chr(92) + "n")
    fake_nvidia_smi(tmp_path, monkeypatch, f"echo \"$@\" > {args_file}\nprintf '{printed}'\nexec sleep 30\n")
    with telemetry.GpuSampler("1234-abcd", interval_ms=50) as s:
        pass
    assert s.result is not None and s.result.samples == 4
    args = args_file.read_text().split()
    assert args[:2] == ["-i", "GPU-1234-abcd"], "the GPU is named by its UUID, whatever CUDA_VISIBLE_DEVICES says"
    assert f"--query-gpu={telemetry.QUERY}" in args and "-lms=50" in args


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_a_driver_without_instant_power_gets_the_averaged_draw(tmp_path, monkeypatch):
    # nvidia-smi before the 530 drivers: an unknown field is an error message and exit code 2
    fake_nvidia_smi(tmp_path, monkeypatch, "case \"$*\" in *power.draw.instant*) "
                    "echo 'Field \"power.draw.instant\" is not a valid field to query.'; exit 2;; esac\n"
                    "printf '1400, 690.0, 0x4\\n'\nexec sleep 30\n")
    with telemetry.GpuSampler("GPU-1234") as s:
        pass
    assert s.result is not None and s.result.samples == 1 and s.result.power_w == 690.0
    assert s.result.query == telemetry.FALLBACK_QUERY, "the one-second average, named as such"
    assert "power.draw.instant" in telemetry.QUERY, "where the driver has it, the instant draw"


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_a_first_sample_caught_half_written_is_waited_for(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "printf '1400, 69'\nsleep 0.2\nprintf '0.0, 0x4\\n'\nexec sleep 30\n")
    with telemetry.GpuSampler("GPU-1234") as s:
        pass
    assert s.result is not None and s.result.power_w == 690.0
    assert s.result.query == telemetry.QUERY, "a line still being written is no reason to give up the instant power"


class FakeNvml:
    """pynvml's calls the sampler makes, on a counter that steps as NVML's does (every ~0.1 s on an H200): it reads
    10,000 J until a step to 10,070 J just after the window opens, then 10,420 J at the step after the work."""

    class NVMLError(Exception):
        pass

    def __init__(self, reads=(10_000_000, 10_000_000, 10_070_000, 10_070_000, 10_070_000, 10_420_000)):
        self.reads, self.handles = list(reads), []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.handles.append(uuid)
        return uuid

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_the_window_energy_is_counted_between_two_steps_of_nvmls_counter(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(telemetry, "MIN_ENERGY_WINDOW_S", 0.0)
    with telemetry.GpuSampler("GPU-1234") as s:
        pass
    assert s.result.energy_j == pytest.approx(350.0), (
        "the energy runs from the counter's step after the window opens (10,070 J) to its step after the work "
        "(10,420 J), in joules: not from a read between two steps")
    assert s.result.window_s > 0 and nvml.handles == ["GPU-1234"] and nvml.reads == [10_420_000]


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_a_window_shorter_than_the_counters_resolution_reports_no_energy(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    with telemetry.GpuSampler("GPU-1234") as s:
        pass  # far shorter than MIN_ENERGY_WINDOW_S
    assert s.result is not None and s.result.samples >= 1, "the clock and power samples are still reported"
    assert s.result.energy_j is None, "NVML's counter steps every ~0.1 s: a short window's energy would be a guess"


def test_a_counter_that_does_not_step_is_waited_for_only_so_long(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(reads=(5_000,)))
    monkeypatch.setattr(telemetry, "COUNTER_STEP_WAIT_S", 0.02)
    value, _ = telemetry._counter_step(telemetry._energy_reader("GPU-1"))
    assert value == 5_000


def test_without_nvml_the_energy_is_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert telemetry._energy_reader("GPU-1") is None
    assert telemetry._counter_step(telemetry._energy_reader("GPU-1"))[0] is None


def test_sustained_settles_then_times_the_sampled_rounds():
    counts = []
    calls = [lambda: counts.append(0), lambda: counts.append(1)]
    per_call, joules, tele = telemetry.sustained(calls, seconds=0.05, uuid=None, settle_s=0.02)
    assert tele is None and joules is None, "no GPU to sample: the timing alone"
    assert per_call > 0 and len(counts) % 2 == 0 and len(counts) > 4, "whole rounds of every call, settling first"


def test_bench_gemm_takes_a_sustain_time_and_refuses_a_negative_one(capsys):
    from pagedref.bench import gemm as bench_gemm

    with pytest.raises(SystemExit):
        bench_gemm.main(["--sustain", "-1"])
    assert "--sustain at least 0" in capsys.readouterr().err


def test_the_sustained_report_gives_energy_a_call_and_pj_per_flop(capsys):
    from pagedref.bench import gemm as bench_gemm

    # q/k/v of the 8B at 256 rows, 25.9 µs a call over 1.5 s: 57,915 calls, 17.8 mJ each (the H200's, 2026-12-03)
    fig = {"us": 25.9, "mj": 17.8, "window_s": 1.5, "energy_j": 1.5 / 25.9e-6 * 17.8e-3, "sm_clock_mhz": 1418.0,
           "power_capped_share": 1.0}
    bench_gemm.print_sustained({"shapes": {"qkv": (4096, 6144)}, "sustained": {"pagedref": {"qkv@256": fig}}})
    out = capsys.readouterr().out
    assert "sustained pagedref qkv@256: 25.9 µs, 17.80 mJ (1.38 pJ/FLOP), 687 W, SM 1418 MHz, power-capped 100%" in out
    # A --tiles tiling's key ("name@M:BNxS") has the same rows, so the same FLOPs a call.
    bench_gemm.print_sustained({"shapes": {"qkv": (4096, 6144)}, "sustained": {"pagedref": {"qkv@256:64x1": fig}}})
    assert "sustained pagedref qkv@256:64x1: 25.9 µs, 17.80 mJ (1.38 pJ/FLOP)" in capsys.readouterr().out


def test_bench_serve_notes_the_runs_clock_and_energy_a_token():
    from pagedref.bench import serve

    tele = telemetry.Telemetry(400, 1450.0, 1200.0, 690.0, 700.0, 1.0, 0.97, energy_j=30_000.0, window_s=44.0)
    assert serve.power_note(tele, 337_000) == ", SM 1450 MHz, power-capped 97%, 89.0 mJ/out token"
    assert serve.power_note(None, 10) == "", "not sampled (the CPU): nothing said"
    no_nvml = telemetry.Telemetry(4, 1980.0, 1980.0, 300.0, 310.0, 0.0, 0.0)
    assert serve.power_note(no_nvml, 10) == ", SM 1980 MHz, power-capped 0%"



def test_sustained_energy_is_the_windows_over_its_calls(monkeypatch):
    counts = []

    class Sampler:  # a window that used 3 J, counting the calls made inside it
        def __init__(self, uuid):
            self.result = None

        def __enter__(self):
            self.start = len(counts)
            return self

        def __exit__(self, *exc):
            Sampler.calls = len(counts) - self.start
            self.result = telemetry.Telemetry(5, 1400.0, 1300.0, 690.0, 700.0, 1.0, 1.0, energy_j=3.0, window_s=0.01)

    monkeypatch.setattr(telemetry, "GpuSampler", Sampler)
    _, joules, tele = telemetry.sustained([lambda: counts.append(0)] * 3, seconds=0.02, uuid="GPU-1", settle_s=0.01)
    assert tele.energy_j == 3.0 and Sampler.calls > 0 and Sampler.calls % 3 == 0, "whole rounds in the window"
    assert joules == pytest.approx(3.0 / Sampler.calls), "joules a call: the window's energy over the calls in it"
