"""IPython loses a failed cell's error output when a second stop press lands while it formats the traceback
(upstream reproduction; needs ipykernel and jupyter_client, no TensorFlow).

`IPython/core/interactiveshell.py`, `InteractiveShell.showtraceback`, wraps the formatting and the display in
`try: ... except KeyboardInterrupt: print('\\n' + self.get_exception_only(), file=sys.stderr)`. A deep library
traceback (Keras, TensorFlow) takes seconds to format on a busy machine, so a user who presses stop twice cuts it
short: the cell shows a bare "KeyboardInterrupt" on stderr and no `error` message reaches the front end (the
execute reply still says error). Run: python ipython_interrupt_during_traceback.py
Expected: an error output. Seen (IPython 9.18, ipykernel 7.4):
    stream='STARTED\\n\\nKeyboardInterrupt\\n\\n' error_output=None reply_status=error
"""

import sys
import threading

from jupyter_client.manager import KernelManager

CELL = '''
import time
class SlowToShow(Exception):
    def __str__(self):  # stands for a traceback that takes seconds to format
        time.sleep(3)
        return "slow"
print("STARTED", flush=True)
raise SlowToShow()
'''

km = KernelManager(kernel_name="python3")
km.kernel_spec.argv[0] = sys.executable
km.start_kernel()
kc = km.client()
kc.start_channels()
kc.wait_for_ready(timeout=60)
try:
    msg_id = kc.execute(CELL)
    out, error = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
            if "STARTED" in msg["content"]["text"]:
                threading.Timer(1.0, km.interrupt_kernel).start()  # the press lands while IPython formats
        elif msg["msg_type"] == "error":
            error = msg["content"]["ename"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=30)
    print(f"stream={''.join(out)!r} error_output={error} reply_status={reply['content']['status']}")
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
