"""Speed and memory harnesses: every number side by side with its baseline from the same run."""
