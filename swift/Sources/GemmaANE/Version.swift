public enum GemmaANEVersion { public static let string = "0.1.0" }
