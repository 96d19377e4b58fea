"""A GRPO trainer in plain torch on a real (tiny) model, driven through rollfleet: see README.md."""
