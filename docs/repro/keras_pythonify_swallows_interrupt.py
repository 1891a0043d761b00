"""Keras 3 drops a KeyboardInterrupt that lands while it converts a batch's logs (upstream reproduction).

`keras/src/utils/python_utils.py`, `pythonify_logs`, converts each log value inside a bare `try: ... except: pass`.
`CallbackList` calls it at every batch begin and end of fit/evaluate/predict, so a Ctrl-C (a Jupyter stop press)
that lands there is swallowed and training goes on. Run: python keras_pythonify_swallows_interrupt.py
Expected: KeyboardInterrupt. Seen (Keras 3.15.1): "swallowed: pythonify_logs returned {'loss': <...>}".
"""

import os
import signal
import threading
import time

from keras.src.utils.python_utils import pythonify_logs


class SlowToConvert:  # stands for a loss tensor whose value is not ready yet (the step still runs)
    def __float__(self) -> float:
        time.sleep(2)
        return 0.0


threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the value converts
try:
    logs = pythonify_logs({"loss": SlowToConvert()})
    print(f"swallowed: pythonify_logs returned {logs}")
except KeyboardInterrupt:
    print("KeyboardInterrupt raised, as expected")
