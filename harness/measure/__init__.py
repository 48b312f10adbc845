"""The measure room: what runs on the ranks of a benchmark (bench: the study's timing
protocol; verify: the losslessness check), the phase timing inside the timed window
(timing) and the result shards (results)."""
