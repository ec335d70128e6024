"""Host loops: train/evaluate/predict drivers, hooks lifecycle, host-side workers, progress and
preemption.
"""
