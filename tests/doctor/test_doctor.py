"""`shardwise doctor`: this machine (no GPU here), and captured readings of an
8× H100 NVLink node with 8 InfiniBand NICs, a mixed A100/V100 box (read through NVML) and a DGX
A100 with NCCL_IB_DISABLE=1 — the hardware spec each gives, the warnings, the spec file that
`plan --hardware` reads, and the known silent failures of a setup."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.doctor import FakeReader, diagnose
from shardwise.doctor.readers import IBV_DEVINFO, NVIDIA_SMI_GPUS, NVIDIA_SMI_TOPO
from shardwise.doctor.setup import Setup, read_setup, silent_failures
from shardwise.errors import ShardwiseError
from shardwise.specs.machine import MachineHardware, load_machine

FIX = Path(__file__).parent / "fixtures"
runner = CliRunner()
VERSIONS = {"python": "3.11.9", "torch": "2.6.0+cu124", "deepspeed": "0.16.4", "transformers": "4.49.0",
            "accelerate": "1.4.0", "peft": "0.14.0", "nccl": "2.21.5", "torch cuda": "12.4"}
MEMINFO_2T = "MemTotal:       2113401284 kB\nMemFree:        2050000000 kB\n"


def _net(ifaces: dict[str, int]) -> tuple[dict[str, str], dict[str, list[str]]]:
    files = {}
    for name, mbps in ifaces.items():
        files[f"/sys/class/net/{name}/speed"] = f"{mbps}\n"
        files[f"/sys/class/net/{name}/operstate"] = "up\n"
    return files, {"/sys/class/net": ["lo", *ifaces]}


def _ib_rates(devices: list[str], rate: str) -> dict[str, str]:
    return {f"/sys/class/infiniband/{d}/ports/1/rate": rate for d in devices}


def h100_node(env: dict[str, str] | None = None) -> FakeReader:
    files, dirs = _net({"eno1": 1000, "enp170s0f0": 100000})
    files |= _ib_rates([f"mlx5_{i}" for i in range(8)], "400 Gb/sec (4X NDR)\n")
    files |= _ib_rates(["mlx5_8"], "100 Gb/sec (4X EDR)\n") | {"/proc/meminfo": MEMINFO_2T}
    return FakeReader(
        commands={NVIDIA_SMI_GPUS: (FIX / "h100_gpus.csv").read_text(),
                  NVIDIA_SMI_TOPO: (FIX / "h100_topo.txt").read_text(),
                  IBV_DEVINFO: (FIX / "h100_ibv_devinfo.txt").read_text()},
        files=files, dirs=dirs, env=env or {}, disk_bytes=(30 * 2**40, 12 * 2**40), cpu_count=224,
        installed=VERSIONS)


def mixed_box() -> FakeReader:
    files, dirs = _net({"eno1": 1000})
    files["/proc/meminfo"] = "MemTotal:       131072000 kB\n"
    return FakeReader(files=files, dirs=dirs, nvml_readings=json.loads((FIX / "mixed_nvml.json").read_text()),
                      disk_bytes=(2 * 2**40, 900 * 2**30), cpu_count=64, installed=VERSIONS)


def ib_disabled_node() -> FakeReader:
    devices = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    files, dirs = _net({"enp226s0": 100000, "enp97s0f1": 25000})
    files |= _ib_rates(devices, "200 Gb/sec (4X HDR)\n") | {"/proc/meminfo": "MemTotal:       2113401284 kB\n"}
    return FakeReader(
        commands={NVIDIA_SMI_GPUS: (FIX / "a100_gpus.csv").read_text(),
                  NVIDIA_SMI_TOPO: (FIX / "a100_topo.txt").read_text(),
                  IBV_DEVINFO: (FIX / "a100_ibv_devinfo.txt").read_text()},
        files=files, dirs=dirs, env={"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"},
        disk_bytes=(15 * 2**40, 3 * 2**40), cpu_count=256, installed=VERSIONS)


def _codes(doc: dict) -> dict[str, str]:
    return {w["code"]: w["message"] for w in doc["warnings"]}


def _doctor_json(monkeypatch, reader: FakeReader, *args) -> tuple[int, dict]:
    import shardwise.doctor as doctor

    monkeypatch.setattr(doctor, "SystemReader", lambda: reader)
    res = runner.invoke(app, ["doctor", "--json", *args])
    return res.exit_code, json.loads(res.output)


def test_h100_nvlink_node_with_8_ib_nics(monkeypatch):
    rc, doc = _doctor_json(monkeypatch, h100_node())
    spec = doc["hardware_spec"]
    assert rc == 0
    assert (spec["gpu"], spec["gpus_per_node"], spec["intra"], spec["inter"], spec["nics_per_node"]) == \
        ("h100-sxm", 8, "nvlink4", "ib-400", 8)
    assert spec["gpu_memory_gb"] == pytest.approx(81559 * 2**20 / 1e9)  # nvidia-smi's MiB, as GB
    assert spec["host_memory_gb"] == pytest.approx(2113401284 * 1024 / 1e9)
    assert spec["notes"] == []  # every reading a plain catalog match
    assert doc["gpu_source"] == "nvidia-smi" and doc["topology_source"] == "nvidia-smi"
    assert len(doc["topology"]) == 8 and all(r[j].startswith("NV18") for i, r in enumerate(doc["topology"])
                                             for j in range(8) if i != j)
    # 9 ports read: 8 NDR InfiniBand + the storage RoCE port, which NCCL's IB count leaves out here
    assert len(doc["ports"]) == 9 and sum(p["link_layer"] == "InfiniBand" for p in doc["ports"]) == 8
    assert [w for w in doc["warnings"] if w["level"] != "note"] == []
    assert doc["status"] == "ok"


def test_mixed_a100_v100_box_read_through_nvml(monkeypatch):
    rc, doc = _doctor_json(monkeypatch, mixed_box())
    spec, codes = doc["hardware_spec"], _codes(doc)
    assert doc["gpu_source"] == "nvml" and doc["topology_source"] == "nvml"
    # planned as the smallest and slowest GPU: 2 of 4 are V100 32 GB
    assert spec["gpu"] == "v100-32g" and spec["gpu_memory_gb"] == pytest.approx(32768 * 2**20 / 1e9)
    assert spec["intra"] == "pcie3"  # no NVLink pair: the V100's own PCIe generation
    assert spec["inter"] == "eth-10" and spec["nics_per_node"] == 1  # eno1 at 1 Gb/s, no IB
    assert "2× NVIDIA A100-PCIE-40GB, 2× Tesla V100-PCIE-32GB" in codes["mixed-gpus"]
    assert "LLaMA-Factory#3520" in codes["mixed-gpus"] and "NVIDIA A100-PCIE-40GB: 0,1" in codes["mixed-gpus"]
    assert "4 GPU pair(s)" in codes["cross-socket"]  # GPU0/1 to GPU2/3: SYS
    assert "pcie-only" in codes
    assert rc == 0 and doc["status"] == "warning"


def test_nccl_ib_disabled_node(monkeypatch):
    rc, doc = _doctor_json(monkeypatch, ib_disabled_node())
    spec, codes = doc["hardware_spec"], _codes(doc)
    assert (spec["gpu"], spec["intra"]) == ("a100-80g", "nvlink3")
    # NCCL falls back to sockets: the fastest Ethernet interface up, not the 8 HDR ports
    assert spec["inter"] == "eth-100" and spec["nics_per_node"] == 1
    assert any("NCCL_IB_DISABLE=1: NCCL uses TCP sockets" in n and "enp226s0 at 100 Gb/s" in n for n in spec["notes"])
    msg = codes["nccl-ib-disabled"]
    assert "8 active InfiniBand/RoCE port(s)" in msg and "ms-swift#1825" in msg
    assert doc["nccl_env"] == {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
    assert rc == 1 and doc["status"] == "error"
    # the same node without the setting: its 8 HDR ports
    ok = diagnose(h100_node()).hardware  # (H100 node for contrast: IB counted)
    assert ok.inter == "ib-400"
    reader = ib_disabled_node()
    reader.env = {}
    assert (diagnose(reader).hardware.inter, diagnose(reader).hardware.nics_per_node) == ("ib-200", 8)


def test_this_machine(tmp_path):
    res = runner.invoke(app, ["doctor", "--json", "--write", str(tmp_path / "hw.yaml")])
    doc = json.loads(res.output)
    spec = doc["hardware_spec"]
    if not doc["gpus"]:  # this project's test machines: no GPU
        assert res.exit_code == 0 and spec["gpu"] is None and spec["intra"] is None
        note = _codes(doc)["no-gpu"]
        cpus = len(os.sched_getaffinity(0))
        assert f"sharing these {cpus} CPU core(s)" in note and "gloo" in note
        assert ("a CPU build" in note) == (doc["versions"].get("torch cuda") is None)
        # the flags' verdict is torch's own (what preflight asks before a 16-bit CPU run): oneDNN's
        # bf16 kernels run exactly where no warning is given
        from shardwise.train.preflight import native_half_matmul

        assert ("cpu-16-bit-matmul" not in _codes(doc)) == native_half_matmul("bf16"), _codes(doc)
        mem = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal:"))
        assert spec["host_memory_gb"] == pytest.approx(mem * 1024 / 1e9)
        # plan --hardware auto says why it cannot plan, exit 2
        res = runner.invoke(app, ["plan", "--hardware", "auto"])
        assert res.exit_code == 2 and "no NVIDIA GPU was found" in " ".join(res.output.split())
    else:
        assert spec["gpu"] is not None or "unknown-gpu" in _codes(doc)
    assert load_machine(tmp_path / "hw.yaml") == MachineHardware.model_validate(spec)


def test_plan_hardware_file_uses_the_spec(tmp_path, monkeypatch):
    _doctor_json(monkeypatch, h100_node(), "--write", str(tmp_path / "h100.yaml"))
    res = runner.invoke(app, ["plan", "--hardware", str(tmp_path / "h100.yaml"), "--json", "-s", "zero3"])
    assert res.exit_code == 0, res.output
    hw = json.loads(res.output)["hardware"]
    assert (hw["gpu"], hw["gpus"], hw["intra"], hw["inter"], hw["nics_per_node"]) == \
        ("h100-sxm", 8, "nvlink4", "ib-400", 8)
    assert hw["gpu_memory_bytes"] == pytest.approx(81559 * 2**20)
    assert hw["hardware_spec"] == str(tmp_path / "h100.yaml")
    # --gpus on the command line: 4 such nodes
    res = runner.invoke(app, ["plan", "--hardware", str(tmp_path / "h100.yaml"), "--gpus", "32", "--json",
                              "-s", "zero3"])
    hw = json.loads(res.output)["hardware"]
    assert (hw["gpus"], hw["nodes"], hw["gpus_per_node"]) == (32, 4, 8)
    # the same plan as the flags that name it
    flags = runner.invoke(app, ["plan", "--gpu", "h100-sxm", "--gpus", "32", "--gpus-per-node", "8",
                                "--interconnect", "ib-400", "--nics-per-node", "8", "--gpu-memory-gb",
                                str(81559 * 2**20 / 1e9), "--host-memory-gb", str(2113401284 * 1024 / 1e9),
                                "--json", "-s", "zero3"])
    a, b = json.loads(res.output), json.loads(flags.output)
    assert a["strategies"] == b["strategies"]
    # explain reads the same spec: its comparison is the one the flags give
    res = runner.invoke(app, ["explain", "--hardware", str(tmp_path / "h100.yaml"), "--gpus", "32", "--json"])
    flags = runner.invoke(app, ["explain", "--gpu", "h100-sxm", "--gpus", "32", "--gpus-per-node", "8",
                                "--interconnect", "ib-400", "--json"])
    assert res.exit_code == 0 and flags.exit_code == 0, (res.output, flags.output)
    a, b = json.loads(res.output), json.loads(flags.output)
    assert "on 32× h100-sxm" in a["text"]
    assert [r["step_s"] for r in a["strategies"]] == pytest.approx([r["step_s"] for r in b["strategies"]], rel=0.02)


def _explain(*args: str) -> dict:
    res = runner.invoke(app, ["explain", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_explain_hardware_file_changes_its_numbers(tmp_path, monkeypatch):
    """explain --hardware FILE explains the node the doctor wrote (8× H100 SXM, 81559 MiB each in
    h100_gpus.csv, NVLink 4, 8 NDR ports) in place of explain's default 8× a100-80g; another --gpu
    beside it is planned as plan plans it (docs/doctor.md: that GPU's own memory and link inside
    the node, the spec's network kept)."""
    spec = str(tmp_path / "h100.yaml")
    _doctor_json(monkeypatch, h100_node(), "--write", spec)
    default, res = _explain(), _explain("--hardware", spec)
    assert "on 8× a100-80g (86 GB), nvlink3 between GPUs" in default["text"]  # 80 GiB
    assert "on 8× h100-sxm (86 GB), nvlink4 between GPUs" in res["text"]  # 81559 MiB = 85.5 GB; one node
    # the memory read, less the 5% plan keeps free by default (plan --margin 0.05)
    assert [r["usable_gb"] for r in res["strategies"]] == pytest.approx([81559 * 2**20 * 0.95 / 1e9] * 5)
    assert [r["name"] for r in res["strategies"]] == [r["name"] for r in default["strategies"]]
    for a100, h100 in zip(default["strategies"], res["strategies"], strict=True):  # H100: more FLOP/s, NVLink
        assert h100["step_s"] < a100["step_s"], (a100, h100)
    # --gpu / --gpus given too: 2 nodes of A100s on the spec's 400 Gb/s InfiniBand, as those flags say it
    mixed = _explain("--hardware", spec, "--gpu", "a100-80g", "--gpus", "16")
    flags = _explain("--gpu", "a100-80g", "--gpus", "16", "--gpus-per-node", "8", "--interconnect", "ib-400")
    assert "on 16× a100-80g (86 GB), ib-400 between GPUs" in mixed["text"]
    assert mixed["strategies"] == flags["strategies"]


def test_explain_hardware_auto_reads_this_machine_as_plan_does(tmp_path, monkeypatch):
    """auto reads the machine now through the doctor's reader (faked: the H100 node), the spec
    doctor --write would have written; with no GPU read, explain refuses it with plan's words."""
    import shardwise.doctor as doctor

    _doctor_json(monkeypatch, h100_node(), "--write", str(tmp_path / "h100.yaml"))  # SystemReader: the H100 node
    auto = _explain("--hardware", "auto")
    assert "on 8× h100-sxm (86 GB), nvlink4 between GPUs" in auto["text"]
    assert auto == _explain("--hardware", str(tmp_path / "h100.yaml"))
    plan = runner.invoke(app, ["plan", "--hardware", "auto", "--json", "-s", "zero3"])
    assert json.loads(plan.output)["hardware"]["gpu"] == "h100-sxm"
    monkeypatch.setattr(doctor, "SystemReader", lambda: FakeReader())  # nothing read: no GPU
    ex, pl = (runner.invoke(app, [cmd, "--hardware", "auto"]) for cmd in ("explain", "plan"))
    assert ex.exit_code == pl.exit_code == 2
    said = " ".join(ex.output.split())
    assert "--hardware auto: no NVIDIA GPU was found" in said and said == " ".join(pl.output.split())


def test_explain_refuses_a_bad_hardware_file_as_plan_does(tmp_path):
    """Each bad spec: exit 2 and one message naming the file (and the line or field), the same
    message plan gives for it."""
    cases = {"absent.yaml": (None, ["hardware spec not found", "doctor --write"]),
             "nospec.yaml": ("gpu: h100-sxm\n", ["not a shardwise hardware spec"]),
             "zero.yaml": ("format: shardwise-hardware/1\ngpu: h100-sxm\ngpus_per_node: 0\n",
                           ["zero.yaml:3", "gpus_per_node"]),
             "typo.yaml": ("format: shardwise-hardware/1\ngpu: h100-sxn\ngpus_per_node: 8\n", ["h100-sxm"])}
    for name, (text, says) in cases.items():
        p = tmp_path / name
        if text is not None:
            p.write_text(text)
        ex, pl = (runner.invoke(app, [cmd, "--hardware", str(p)]) for cmd in ("explain", "plan"))
        said = " ".join(ex.output.split())
        assert ex.exit_code == pl.exit_code == 2, (name, ex.output)
        assert str(p) in said and all(w in said for w in says), (name, said)
        assert said == " ".join(pl.output.split()), name


def test_bad_hardware_files_name_the_field(tmp_path):
    p = tmp_path / "hw.yaml"
    p.write_text("format: shardwise-hardware/1\ngpu: h100-sxn\ngpus_per_node: 8\n")
    with pytest.raises(ShardwiseError, match=r"hw.yaml:2: field 'gpu': unknown GPU.*h100-sxm"):  # did-you-mean
        load_machine(p)
    p.write_text("format: shardwise-hardware/1\ngpu: h100-sxm\ngpus_per_node: 0\n")
    with pytest.raises(ShardwiseError, match=r"hw.yaml:3.*gpus_per_node"):
        load_machine(p)
    p.write_text("gpu: h100-sxm\n")
    with pytest.raises(ShardwiseError, match="not a shardwise hardware spec"):
        load_machine(p)


# --- known silent failures of a setup ------------------------------------------------------------


def test_fsdp2_qlora_uint8_storage(tmp_path):
    acc = tmp_path / "accelerate.yaml"
    acc.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
                                   "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True},
                                   "mixed_precision": "bf16", "num_processes": 8}))
    s = read_setup(acc)
    assert s.engine == "fsdp2"
    assert silent_failures(s) == []  # no 4-bit base: nothing to say
    qlora = Setup(engine="fsdp2", four_bit=True)
    [f] = silent_failures(qlora)
    assert f.code == "fsdp2-qlora-uint8" and "accelerate#3983" in f.message and "uint8" in f.message
    assert silent_failures(Setup(engine="fsdp2", four_bit=True, quant_storage="bfloat16")) == []


def test_zero3_4bit_base_and_hpz_from_files(tmp_path):
    ds = tmp_path / "ds_z3.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {
        "stage": 3, "zero_hpz_partition_size": 8, "stage3_prefetch_bucket_size": "auto"}}))
    # LLaMA-Factory's QLoRA + DeepSpeed example keys
    lf = tmp_path / "llama3_lora_sft_ds3.yaml"
    lf.write_text(yaml.safe_dump({"model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct",
                                  "quantization_bit": 4, "finetuning_type": "lora", "deepspeed": "ds_z3.json"}))
    s = read_setup(lf)
    assert (s.engine, s.zero_stage, s.four_bit, s.hpz_partition_size) == ("deepspeed", 3, True, 8)
    codes = {f.code: f.message for f in silent_failures(s, "0.16.4")}
    assert "ZeRO-3 cannot partition" in codes["zero3-4bit-unsharded"]
    assert "DeepSpeed#6926" in codes["zero-hpz"] and "DeepSpeed 0.16.4" in codes["zero-hpz"]
    assert "ds_z3.json: zero_optimization.stage" in s.keys_read
    # axolotl: load_in_4bit with a float storage, ZeRO-2: nothing silent
    ax = tmp_path / "axolotl.yaml"
    ax.write_text(yaml.safe_dump({"base_model": "x", "load_in_4bit": True, "adapter": "qlora",
                                  "bnb_4bit_quant_storage": "bfloat16",
                                  "deepspeed": str(tmp_path / "z2.json")}))
    (tmp_path / "z2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert silent_failures(read_setup(ax)) == []


def test_doctor_setup_flags_and_exit(monkeypatch, tmp_path):
    rc, doc = _doctor_json(monkeypatch, h100_node(), "-s", "zero3", "--qlora")
    assert rc == 1 and [f["code"] for f in doc["silent_failures"]] == ["zero3-4bit-unsharded"]
    rc, doc = _doctor_json(monkeypatch, h100_node(), "-s", "zero3", "--qlora", "--quant-storage", "bfloat16")
    assert rc == 0 and doc["silent_failures"] == []


def test_nccl_settings_that_cannot_work(monkeypatch):
    rc, doc = _doctor_json(monkeypatch, h100_node({"NCCL_SOCKET_IFNAME": "eth0", "NCCL_P2P_DISABLE": "1"}))
    codes = _codes(doc)
    assert "matches no interface here" in codes["nccl-socket-ifname"] and "enp170s0f0" in codes["nccl-socket-ifname"]
    assert "instead of NVLink" in codes["nccl-p2p-disabled"]
    assert doc["hardware_spec"]["intra"] == "pcie5"  # staged through the host: the H100's PCIe 5
    assert rc == 1
    # a prefix that matches (NCCL's default matching) is fine
    _, doc = _doctor_json(monkeypatch, h100_node({"NCCL_SOCKET_IFNAME": "enp"}))
    assert "nccl-socket-ifname" not in _codes(doc)


def test_doctor_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from shardwise.doctor import SystemReader, diagnose; diagnose(SystemReader()); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_trainer_preflight_plans_the_spec(tmp_path, monkeypatch):
    from shardwise.config.load import validate
    from shardwise.run import run_spec

    _doctor_json(monkeypatch, h100_node(), "--write", str(tmp_path / "h100.yaml"))
    cfg = validate({"hardware": {"machine": str(tmp_path / "h100.yaml"), "gpus_per_node": 8}}, source="t.yaml")
    hw = run_spec(cfg, 16, "cuda", environ={}).hardware
    assert (hw.gpu.name, hw.nodes, hw.intra.name, hw.inter.name, hw.nics_per_node) == \
        ("h100-sxm", 2, "nvlink4", "ib-400", 8)
    assert hw.gpu.memory_bytes == pytest.approx(81559 * 2**20)
    # hardware.gpu given too: that GPU, with its own memory and link inside the node
    cfg = validate({"hardware": {"machine": str(tmp_path / "h100.yaml"), "gpu": "a100-80g"}}, source="t.yaml")
    hw = run_spec(cfg, 8, "cuda", environ={}).hardware
    assert (hw.gpu.name, hw.intra.name, hw.inter.name) == ("a100-80g", "nvlink3", "ib-400")
    # auto on this machine: read now (no GPU here: the catalog GPU the config names)
    cfg = validate({"hardware": {"machine": "auto"}}, source="t.yaml")
    monkeypatch.setattr("shardwise.doctor.SystemReader", lambda: ib_disabled_node())
    hw = run_spec(cfg, 8, "cuda", environ={}).hardware
    assert (hw.gpu.name, hw.inter.name) == ("a100-80g", "eth-100")


class _FakePynvml:
    """pynvml's calls as the doctor makes them, over a described board: `buses` per GPU and the
    PCI bus each active NVLink ends at (another GPU's, or an NVSwitch's)."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    class NVMLError(Exception):
        pass

    def __init__(self, names, buses, links, ancestor=50):
        self.names, self.buses, self.links, self.ancestor = names, buses, links, ancestor
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h].encode()  # older pynvml returns bytes

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": self.buses[h].lower()})()

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": 81559 * 2**20})()

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.links[h]):
            raise self.NVMLError("not supported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return type("Pci", (), {"busId": self.links[h][link]})()

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor


def test_nvml_reader_topology(monkeypatch):
    import sys

    from shardwise.doctor import SystemReader

    buses = [f"00000000:{b}:00.0" for b in ("18", "2A", "3A", "5D")]
    switch = "00000000:C5:00.0"
    # NVSwitch board: every GPU's 18 links end at switches -> every pair NV
    fake = _FakePynvml(["NVIDIA H100 80GB HBM3"] * 4, buses, [[switch] * 18] * 4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    got = SystemReader().nvml()
    assert [g["topology"] for g in got] == [["NV" if i != j else "X" for j in range(4)] for i in range(4)]
    assert got[0]["nvlinks"] == 18 and got[0]["name"] == "NVIDIA H100 80GB HBM3" and fake.shut
    # PCIe cards with NVLink bridges in pairs (0-1, 2-3): only the bridged pairs are NV
    bridged = _FakePynvml(["NVIDIA A100 80GB PCIe"] * 4, buses, [[buses[1]] * 12, [buses[0]] * 12,
                                                                 [buses[3]] * 12, [buses[2]] * 12], ancestor=40)
    monkeypatch.setitem(sys.modules, "pynvml", bridged)
    topo = [g["topology"] for g in SystemReader().nvml()]
    assert topo[0] == ["X", "NV", "NODE", "NODE"] and topo[2] == ["NODE", "NODE", "X", "NV"]
    reader = FakeReader(nvml_readings=SystemReader().nvml(), installed=VERSIONS)
    spec = diagnose(reader).hardware
    assert spec.gpu == "a100-80g" and spec.intra == "pcie4"  # a ring over 4 crosses PCIe
    assert any("NVLink joins 2 of 6 GPU pairs" in n for n in spec.notes)


def test_shardwise_yaml_qlora_on_a_sharding_strategy(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"strategy": {"name": "zero3"}, "lora": {"rank": 16, "quantization": "nf4"}}))
    s = read_setup(cfg)
    assert (s.strategy, s.engine, s.zero_stage, s.four_bit) == ("zero3", "deepspeed", 3, True)
    [f] = silent_failures(s)
    assert f.code == "qlora-sharded" and "refuses it before any rank starts" in f.message
    cfg.write_text(yaml.safe_dump({"strategy": {"name": "zero2"}, "lora": {"rank": 16, "quantization": "nf4"}}))
    assert silent_failures(read_setup(cfg)) == []  # a replicated base: what the trainer runs


AVX2_FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2"
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl"


@pytest.mark.parametrize(("flags", "warned"), [(AVX2_FLAGS, True), (AVX512_FLAGS, False),
                                               (AVX2_FLAGS + " avx_vnni avx_ne_convert", False), (None, False)])
def test_a_cpu_without_avx512_is_told_its_16_bit_products_are_slow(flags, warned):
    """Read from /proc/cpuinfo's flags (an AMD EPYC with AVX2 only, as this project's machines
    sometimes are; an AVX-512 server; AVX2-VNNI-2; an ARM host with no `flags` line)."""
    files = {"/proc/cpuinfo": f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n"} if flags else {}
    doc = diagnose(FakeReader(files=files)).as_dict()
    codes = _codes(doc)
    assert ("cpu-16-bit-matmul" in codes) == warned
    if warned:
        assert "precision: fp32" in codes["cpu-16-bit-matmul"] and "run.timeout_s" in codes["cpu-16-bit-matmul"]
