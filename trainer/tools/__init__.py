"""The trainer's tools beside the loop: supervised warm start (`sft.py`), the replay gate's
calibration (`calibrate.py`) and the GPU memory planner (`memory_plan.py`)."""
