pub mod fake_manager;
