"""Print the result rows under the given folders, a line each (GPU checklist)."""
import sys

from harness.measure import results

for folder in sys.argv[1:]:
    try:
        df = results.load(folder)
    except Exception as exc:  # noqa: BLE001
        print(f"{folder}: cannot load: {exc}")
        continue
    if df.empty:
        print(f"{folder}: no rows")
        continue
    first = df.iloc[0]
    print(f"{folder}: torch {first.torch_version} cuda {first.cuda_version} cudnn "
          f"{first.cudnn_version} nccl {first.nccl_version} backend {first.backend} "
          f"device {first.device} comm_env {first.comm_env_json}")
    for _, r in df.sort_values(["model", "method", "run_id", "repeat"]).iterrows():
        gb = (r.peak_memory_bytes or 0) / 2**30
        print(f"  {r.model:14s} {r.method:18s} {str(r.engine):7s} rep{r['repeat']} {r.status:6s} "
              f"{r.throughput:9.1f}/s fwd {1e3*(r.forward_s or 0):7.2f} bwd "
              f"{1e3*(r.backward_s or 0):7.2f} comm {1e3*(r.comm_s or 0):7.2f} upd "
              f"{1e3*(r.update_s or 0):6.2f} ms  host {1e3*(r.method_host_s or 0):5.2f} wait "
              f"{1e3*(r.method_wait_s or 0):5.2f} peak {gb:6.2f} GiB tf32 {r.tf32_matmul}/"
              f"{r.tf32_cudnn} bench {r.cudnn_benchmark} sync {r.sync_each_step} rate "
              f"{r.rate} (window {r.throughput_window:.1f}, study {r.throughput_study:.1f}) "
              f"dev {r.devices} "
              f"{'' if r.status == 'ok' else r.error}")
