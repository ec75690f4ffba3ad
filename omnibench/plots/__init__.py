"""Paper-style figures and the HTML report (matplotlib/seaborn; no torch).

- `load`: every result format the figures read (run and simulation record folders), one place.
- `style`: fixed colours per system/module/modality, sizes, PNG + PDF output.
- `figures`: throughput, scaling, dynamic, timeline, validation, ablation, workload.
- `report`: one self-contained HTML page with every figure that the inputs can make.
"""
