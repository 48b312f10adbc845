"""The predict room: the discrete-event model of an iteration (model), networks and
collectives (network), the plans the methods would run (plans), compute profiles
(profile) and calibration on measured cells (calibrate). Imports no torch: torch is
loaded only when a profile must be measured. See harness/predict/README.md."""
