"""Training and scoring: the loop, the compiled step, cost, protocol scoring, transduction."""
