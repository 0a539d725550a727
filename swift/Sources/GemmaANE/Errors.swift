import Foundation

/// The one error the package throws. `message` is one line that names the file, field or value at fault,
/// as the Python package's errors do (`gemma_ane/errors.py`); `kind` lets an app branch without parsing it.
public struct GemmaANEError: Error, Equatable, CustomStringConvertible, LocalizedError, Sendable {
    public enum Kind: String, Sendable {
        /// A bundle file that is missing, damaged, or states something this package cannot run.
        case bundle
        /// A caller's argument or request (a prompt past the context, a sampling option out of range).
        case input
        /// The device (Core ML, the Python executor behind the pipe) failed or refused.
        case device
        /// A chunk function the device cannot load; the engine falls back to the next prompt path.
        case functionUnavailable
        /// A generation stopped by its caller.
        case cancelled
    }

    public let kind: Kind
    public let message: String

    public init(_ kind: Kind, _ message: String) {
        self.kind = kind
        self.message = message
    }

    public var description: String { message }
    public var errorDescription: String? { message }
}
