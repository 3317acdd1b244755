"""Disk budgets: a namespace's bytes, reserved before they land, and one budget for a
whole storage root shared by every namespace and process on it."""
