"""Training of the early-exit methods' add-ons: on-policy training data (:mod:`.data`)
and the training loops (:mod:`.train`) for AdaDecode's intermediate LM heads and
SpecEE's exit predictors. The modules themselves live with the methods that run them
(:mod:`selfspec_cli.methods.exit_heads`), and so do their artifacts
(:mod:`selfspec_cli.methods.head_store`).

Import direction: ``cli -> heads -> methods -> decoding -> engine``. No typer, rich or
optuna here.
"""
