"""Trained add-ons of the early-exit methods: AdaDecode's intermediate LM heads and
SpecEE's exit predictors (:mod:`.modules`), on-policy training data (:mod:`.data`),
training loops (:mod:`.train`) and their artifacts (:mod:`.store`).

Import direction: ``cli -> heads -> engine``; methods import :mod:`.modules` and
:mod:`.store` only. No typer, rich or optuna here.
"""
