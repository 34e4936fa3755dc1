"""scripts/bench_onednn.py at its smallest (no candidate download), so the script the oneDNN
pin and the f32 library are decided by keeps running: the probe builds against the pinned
oneDNN, every library side computes the same product, and the report names the kernels."""
import json
import struct

from scripts import bench_onednn as bench


def operand(seed: int, i: int, bf16: bool) -> float:
    """The probe's operand i as stored: float32, or bf16 by dropping the low 16 bits."""
    v = struct.unpack("<I", struct.pack("<f", 0.5 + 0.01 * ((i * 7 + seed) % 97)))[0]
    return struct.unpack("<f", struct.pack("<I", v & 0xFFFF0000 if bf16 else v))[0]


def test_smoke_run_times_each_library_and_checks_the_product(tmp_path):
    rc = bench.main(["--shapes", "smoke", "--no-candidate", "--rounds", "1", "--reps", "3",
                     "--threads", "1", "--results", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "onednn.json").read_text())
    rows = r["rows"]
    sides = [("f32", "onednn-pinned"), ("f32", "openblas")]
    if r["bf16_matmul"]:        # oneDNN 3.2 has no bf16 matmul on an AVX2-only CPU
        sides.append(("bf16", "onednn-pinned"))
    assert {(x["shape"], x["type"], x["side"]) for x in rows} == {
        (s, t, side) for s in ("small fwd", "small bwd") for t, side in sides}
    for x in rows:
        assert x["median_s"] > 0 and x["gflops"] > 0, x
        # c[0][0] = sum over K of the probe's a[0][k] * b[k][0]: every library the same sum
        bf16 = x["type"] == "bf16"
        a = [operand(1, i, bf16) for i in range(x["K"])]
        b = [operand(2, k if x["transb"] else k * x["N"], bf16) for k in range(x["K"])]
        exact = sum(p * q for p, q in zip(a, b))
        # products of the stored operands summed in float32: K roundings of a positive sum
        assert abs(x["c00"] - exact) <= x["K"] * 2.0 ** -24 * exact, x
    assert {x["library"] for x in rows} == {"oneDNN 3.2.0", "OpenBLAS"}
    assert all(x["impl"] for x in rows)
    md = (tmp_path / "onednn.md").read_text()
    assert r["machine"]["cpu"] in md and "| small fwd | f32 |" in md
    q = {(x["shape"], x["type"]): x for x in r["ratios"]}
    assert q[("small fwd", "f32")]["onednn_over_openblas"] > 0
    assert q[("small fwd", "f32")]["candidate_over_pinned"] is None
