"""Byzantine-robust aggregation: pure rules, pre-aggregators, attack simulation, and the strategy's engine."""
