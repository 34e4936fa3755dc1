"""Serve this machine's CPU (or GPU) device to pytrain runs elsewhere, over ggml's RPC protocol.

    python -m pytrain.rpc_server --endpoint 127.0.0.1:50052 [--device cpu|cuda] [--threads N]

A run then uses it with ``model.device = "rpc:127.0.0.1:50052"``: weights, adapter and
optimizer state live in the server's memory and the graphs run there, the scheduler copying
inputs and results across, as it does for a GPU.  The server is ggml's own
(``ggml_backend_rpc_start_server``), on the device modules this build loads.  It trusts
whoever connects: bind it to 127.0.0.1 or a private network.

Why here: a device that is not host memory exists on every machine this way, so the GPU code
path (device-resident weights, copies between backends, kept graphs on the device, the
CPU-fallback check) is tested on CPU machines (tests/test_rpc_device.py).
"""
from __future__ import annotations

import argparse
import sys

from pytrain import ggml
from pytrain.ggml import ffi, lib


def serve(endpoint: str, device: str = "cpu", threads: int | None = None) -> None:
    """Block serving ``device`` at ``endpoint`` (HOST:PORT) until the process ends."""
    kind = {"cpu": lib.GGML_BACKEND_DEVICE_TYPE_CPU, "cuda": lib.GGML_BACKEND_DEVICE_TYPE_GPU}
    dev = lib.ggml_backend_dev_by_type(kind[device])
    if dev == ffi.NULL:
        raise SystemExit(f"error: no {device} device in this build")
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if reg == ffi.NULL:
        raise SystemExit("error: this build has no RPC backend (libggml-rpc.so)")
    start = ffi.cast("void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *)",
                     lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_start_server"))
    devices = ffi.new("ggml_backend_dev_t[1]", [dev])
    sys.stdout.flush()
    start(endpoint.encode(), ffi.NULL, threads or ggml.default_threads(), 1, devices)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="127.0.0.1:50052", help="HOST:PORT to listen on")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    serve(a.endpoint, a.device, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
