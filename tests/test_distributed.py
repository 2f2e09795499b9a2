"""Two processes on localhost as one JAX runtime (specjax.distributed), each with 2 forced CPU devices: one model
split over the 4, against one process.

Each process runs tests/distributed_worker.py (a process joins the runtime before JAX starts, so not this one);
this process computes the same outputs on one device and compares.
"""

import dataclasses
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import specjax
from specjax import distributed
from specjax.config import from_hf_config, save_config
from specjax.configs.models import MODEL_SHAPES
from specjax.errors import SpecjaxError

import distributed_worker  # tests/ is on the path; its `outputs` is what both sides compute
from processes import DEVICES_PER_PROCESS, PROCESSES, free_port, needs_cpu_collectives, run_workers

EXACT = 1e-5  # fp32: the same computation, summed over heads in another order
WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")
TIMEOUT_S = 300


def _run_processes(models: list[str], out: pathlib.Path) -> list[dict]:
    return run_workers(WORKER, out, models, TIMEOUT_S)


def _cut(name: str, layers: int, folder: pathlib.Path) -> str:
    """A registered shape as a folder with its config.json, cut to `layers` layers."""
    path = folder / name
    path.mkdir()
    save_config(dataclasses.replace(from_hf_config(MODEL_SHAPES[name]), num_layers=layers), path / "config.json")
    return str(path)


def _check_placement(reports: list[dict], model: str, sharded_axes: list[str]) -> None:
    """The mesh spans both processes, and each holds only its devices' slices of a split parameter: together
    the processes' slices are the whole, none twice."""
    for process, report in enumerate(reports):
        assert (report["process_index"], report["process_count"]) == (process, PROCESSES)
        assert report["device_count"] == PROCESSES * DEVICES_PER_PROCESS
        assert report["local_device_count"] == DEVICES_PER_PROCESS
    cases = [next(c for c in r["cases"] if c["model"] == model) for r in reports]
    tp = PROCESSES * DEVICES_PER_PROCESS
    for c in cases:
        assert c["mesh_processes"] == list(range(PROCESSES)) and c["mesh_devices"] == tp, model
        assert c["sharded_axes"] == sharded_axes, model
        assert not c["wq_fully_addressable"], model
        assert len(c["wq"]) == len(c["w_up"]) == DEVICES_PER_PROCESS, model
        heads = c["wq_shape"][1]
        split = "q_heads" in sharded_axes
        assert all(s["shape"][1] == (heads // tp if split else heads) for s in c["wq"]), model
        assert all(s["shape"][1] == c["w_up_shape"][1] // tp for s in c["w_up"]), model
        assert "every process needs some" in c["short_mesh_error"], model
        assert "differ from process 0's" in c["other_seed_error"], model
    units = sorted(tuple(s["index"][1]) for c in cases for s in c["w_up"])  # the MLP's hidden units
    width = cases[0]["w_up_shape"][1]
    assert units == [(i * width // tp, (i + 1) * width // tp) for i in range(tp)], model


def _check_outputs(path: str, out: pathlib.Path) -> None:
    """Every process's outputs equal one process's (one device, the same weights)."""
    model = specjax.load_model(path, init="random", seed=1)
    one = distributed_worker.outputs(model)
    label = pathlib.Path(path).name
    for process in range(PROCESSES):
        got = np.load(out / f"{label}.process{process}.npz")
        # a split parameter gathered whole from both processes is the one process's
        np.testing.assert_array_equal(got["wq"], model.params["layers"][0]["wq"], err_msg=f"{label} {process}")
        for key in ("logits", "engine_first", "engine_continuation"):
            assert got[key].shape == one[key].shape, (label, process, key)
            diff = float(np.abs(got[key] - one[key]).max())
            assert diff <= EXACT, (label, process, key, diff)
        np.testing.assert_array_equal(got["greedy"], one["greedy"], err_msg=f"{label} process {process}")


@needs_cpu_collectives
def test_two_processes_match_one(tmp_path):
    """tiny-opt: 4 query and 4 KV heads and 128 MLP units, each split over the 4 devices (one head each)."""
    reports = _run_processes(["tiny-opt"], tmp_path)
    _check_placement(reports, "tiny-opt", ["ffw", "kv_heads", "q_heads"])
    _check_outputs("tiny-opt", tmp_path)


@pytest.mark.slow
@needs_cpu_collectives
def test_two_processes_llama_shapes(tmp_path):
    """tiny-llama (4 query heads split, its 2 KV heads replicated over 4 devices) and smollm2-135m's shape cut to
    2 layers (9 query heads: only the MLP divides 4 devices)."""
    paths = ["tiny-llama", _cut("smollm2-135m", 2, tmp_path)]
    reports = _run_processes(paths, tmp_path)
    _check_placement(reports, "tiny-llama", ["ffw", "q_heads"])
    _check_placement(reports, "smollm2-135m", ["ffw"])
    for path in paths:
        _check_outputs(path, tmp_path)


def test_initialize_errors():
    with pytest.raises(SpecjaxError, match="HOST:PORT"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(SpecjaxError, match="process_id must be one of 0..1"):
        distributed.initialize("localhost:1234", 2, 2)
    with pytest.raises(SpecjaxError, match="num_processes"):
        distributed.initialize("localhost:1234", 0, 0)
    jax.devices()  # JAX has started in this process
    with pytest.raises(SpecjaxError, match="before JAX starts"):
        distributed.initialize(f"localhost:{free_port()}", 2, 0)


def test_one_process_is_unchanged():
    """Without `initialize`, a result on this process's devices reaches the host as np.asarray gives it."""
    x = jax.numpy.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(distributed.to_host(x), np.asarray(x))
    model = specjax.load_model("tiny-llama", init="random", seed=1, tensor_parallel=1)
    assert model.mesh is None and jax.process_count() == 1


FATAL_RECORD = [  # what JAX's runtime writes before it aborts a process whose coordination service is gone
    "W1207 06:34:03.854816   16434 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from "
    "coordination service: UNAVAILABLE: Socket closed",
    "Additional GRPC error information from remote target coordination_service while calling GetKeyValue:",
    "E1207 06:34:25.788940   16506 coordination_service_agent.cc:289] Polled an error from coordination service.",
    "F1207 06:34:25.788983   16506 client.h:80] Terminating process because the JAX distributed service detected "
    "fatal errors. This most likely indicates that another task died. absl::Status: UNAVAILABLE: Failed to send RPC "
    "to coordination service. Either the leader task was preempted/died/restarted unexpectedly.",
    ":UNKNOWN:Error received from peer  {grpc_status:14}",
    "*** Check failure stack trace: ***",
    "    @     0x7f8939c40634  absl::log_internal::LogMessage::SendToLog()",
]


def _runtime_log(lines: list[str]) -> list[str]:
    script = pathlib.Path(distributed.__file__).with_name("runtime_log.py")
    done = subprocess.run([sys.executable, "-I", str(script), "1", "2"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_runtime_fatal_is_said_in_one_line():
    """A process's stderr through specjax.runtime_log: everything else passes as it is; the runtime's abort when its
    coordination service is gone (with the client's warnings before it) becomes one line."""
    other = ["I1207 06:00:00.000000   1 cpu_client.cc:1] an ordinary record", "a Python traceback line",
             "W1207 06:00:01.000000   2 preemption_sync_manager.cc:147] a warning with no fatal record after it",
             "  its second line"]
    assert _runtime_log(other) == other
    assert _runtime_log(other[2:] + ["a line of Python's"]) == other[2:] + ["a line of Python's"]  # after the held
    said = "specjax: process 1 of 2 stops: a step across processes failed: ..."  # distributed's own stop
    assert _runtime_log(other[:1] + FATAL_RECORD[:3] + [said]) == other[:1] + [said]
    assert _runtime_log(other[:2] + FATAL_RECORD) == other[:2] + [
        "specjax: process 1 of 2 stops: the runtime's coordination service reports UNAVAILABLE: Failed to send RPC to "
        "coordination service (process 0, which holds it, killed or crashed?); its uncommitted work is dropped"]
