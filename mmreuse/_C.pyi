"""mmreuse._C registers the residency torch ops (torch.ops.mmreuse.*) on import; see ops.py."""
