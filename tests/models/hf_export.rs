//! Export.
