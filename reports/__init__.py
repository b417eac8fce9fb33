"""Reports: the plots and the study report, read from stage results; the run report stage
(stages/report.py), the sweep's study callback (reports/sweep.py) and compare (stages/compare.py) write them."""
