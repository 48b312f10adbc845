"""GPU checklist step 11: each thread started by methods.base.start_thread prints, from
inside the thread, its current device and stream (PYTHONPATH=.gpu/site for those runs)."""
import threading

_start = threading.Thread.start


def _start_shown(self):
    fn = getattr(self, "_target", None)
    code = getattr(fn, "__code__", None)
    if code is not None and fn.__qualname__ == "start_thread.<locals>.run" \
            and "target" in code.co_freevars:
        cell = fn.__closure__[code.co_freevars.index("target")]
        inner = cell.cell_contents

        def shown():
            import torch
            where = "cpu"
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                s = torch.cuda.current_stream()
                where = (f"device={torch.cuda.current_device()} stream_id={s.stream_id} "
                         f"cuda_stream={s.cuda_stream:#x} legacy_default={s.cuda_stream == 0}")
            print(f"[step11 thread] {threading.current_thread().name} "
                  f"tid={threading.get_native_id()} {where}", flush=True)
            return inner()
        cell.cell_contents = shown
    return _start(self)


threading.Thread.start = _start_shown
