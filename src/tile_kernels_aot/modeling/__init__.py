"""Autograd wrappers (``torch.autograd.Function``) over the operators."""
