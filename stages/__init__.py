"""One module per stage: env_check, bandwidth, lr_find, plan, train, report."""
