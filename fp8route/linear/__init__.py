"""The FP8 linear layer, its plan (which backend runs each M bucket), the policy that steers
planning, and explain."""
