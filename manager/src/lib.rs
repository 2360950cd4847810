//! The anneal manager: controllers for claims and readiness rules, and the
//! CRD YAML generator.

pub mod crdgen;
