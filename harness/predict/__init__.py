"""The predict room: the discrete-event model of an iteration (model), networks and
collectives (network), the plans the methods would run (plans), compute profiles
(profile; traced with torch by trace, only where the cache lacks a FLOP count or the
compute is measured), calibration on measured cells (calibrate) and a sweep's rows and
best methods (sweep). Imports no torch. See harness/predict/README.md."""
