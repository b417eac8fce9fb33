"""Reports: the plots and the study report, read from stage results; the run report stage
(stages/report.py), the study callback (pipelines/study.py) and compare (stages/compare.py) write them."""
